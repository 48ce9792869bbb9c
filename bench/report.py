"""Reports for `specinfer bench` and `specinfer experiment`: results.json, markdown tables and PNG plots.

Plots use matplotlib's Agg backend (no display needed); without matplotlib they are skipped with
a warning and the markdown still lists every figure.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

PLOTS = ("speedup", "accepted_lengths", "acceptance_by_depth", "proposer_share", "load")


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _cell(summary: dict, key: str, digits: int = 2) -> str:
    """``median (p25-p75)`` of one summary figure."""
    spread = (summary.get("spread") or {}).get(key)
    if summary.get(key) is None:
        return "n/a"
    if not spread:
        return _num(summary[key], digits)
    return f"{_num(summary[key], digits)} ({_num(spread['p25'], digits)}-{_num(spread['p75'], digits)})"


def _match_cell(summary: dict) -> str:
    fraction = summary.get("outputs_match_incremental")
    if fraction is None:
        return "n/a"
    diverged = [i for i in summary["first_divergence"].values() if i is not None]
    note = f"; first divergence at token {min(diverged)}" if diverged else ""
    return f"{fraction:.0%}{note}"


def _drafted(summary: dict) -> bool:
    """A speculative engine method (it has per-proposer counts and drafts with someone)."""
    return summary.get("accepted_per_proposer") is not None and bool(summary.get("proposers"))


def _compares_with_peer(summary: dict) -> bool:
    """Whether the run has `hf-assisted` rows to compare each method with, prompt by prompt."""
    return any(s.get("speedup_vs_hf_assisted") is not None for s in summary.values())


def summary_table(summary: dict) -> list[str]:
    """The main table: one row per method, medians over prompts with the p25-p75 spread."""
    peer = _compares_with_peer(summary)
    lines = ["| method | prompts | tokens / step | ms / token | speedup vs incremental "
             + ("| speedup vs hf-assisted " if peer else "") + "| mean accepted / step | output = incremental |",
             "|---|---:|---:|---:|---:|" + ("---:|" if peer else "") + "---:|---|"]
    for method, s in summary.items():
        versus_peer = f"| {_cell(s, 'speedup_vs_hf_assisted')} " if peer else ""
        lines.append(f"| `{method}` | {s['prompts']} | {_cell(s, 'tokens_per_step')} | {_cell(s, 'ms_per_token', 1)} "
                     f"| {_cell(s, 'speedup_vs_incremental')} {versus_peer}| {_num(s.get('mean_accepted_per_step'))} "
                     f"| {_match_cell(s)} |")
    return lines


def profile_table(summary: dict) -> list[str]:
    """The step profile: what each verify step drafted and what it cost (engine methods)."""
    rows = [(m, s) for m, s in summary.items() if s.get("nodes_per_step") is not None]
    lines = ["| method | tree nodes / step | drafting ms / step | of it transport | verify ms / step | accepted / step |",
             "|---|---:|---:|---:|---:|---:|"]
    for method, s in rows:
        lines.append(f"| `{method}` | {s['nodes_per_step']:.1f} | {s['draft_ms_per_step']:.1f} "
                     f"| {_num(s.get('transport_ms_per_step'), 1)} | {s['verify_ms_per_step']:.1f} "
                     f"| {_num(s.get('mean_accepted_per_step'))} |")
    return lines if rows else []


def proposer_table(summary: dict) -> list[str]:
    """Share of accepted tokens credited to each proposer (a token proposed by several credits each)."""
    rows = [(m, s) for m, s in summary.items() if _drafted(s)]
    names = sorted({n for _, s in rows for n in s["proposers"]})
    if not rows:
        return []
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for method, s in rows:
        used = s["proposers"]
        lines.append(f"| `{method}` | " + " | ".join(
            f"{s['proposer_share'].get(n, 0.0):.0%}" if n in used else "-" for n in names) + " |")
    return lines


def _same_cell(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**no**")


def load_table(load: dict) -> list[str]:
    """The load table: one row per (method, concurrency), with the run's label in every row."""
    lines = ["| label | method | concurrency | requests | errors | agg tok/s | agg tok/s vs C=1 | ms/token p50 "
             "| ms/token p95 | TTFT ms p50 | TTFT ms p95 | tree nodes / step | plain steps | same tokens at every C |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    same = load["identical_across_concurrency"]
    for r in load["levels"]:
        lines.append(f"| {load['label'] or '-'} | `{r['method']}` | {r['concurrency']} | {r['requests']} "
                     f"| {r['errors']} | {_num(r['aggregate_tokens_per_s'], 1)} "
                     f"| {_num(r['speedup_vs_concurrency_1'])} | {_num(r['ms_per_token_p50'], 1)} "
                     f"| {_num(r['ms_per_token_p95'], 1)} | {_num(r['ttft_ms_p50'], 0)} "
                     f"| {_num(r['ttft_ms_p95'], 0)} | {_num(r.get('tree_nodes_mean'), 1)} "
                     f"| {_num(r.get('plain_step_share'))} | {_same_cell(same.get(r['method']))} |")
    return lines


def load_section(load: dict) -> list[str]:
    """Heading, definitions, the table and any error messages."""
    errors = sorted({e for r in load["levels"] for e in r["error_examples"]})
    return [f"## Load: {load['requests_per_level']} requests per concurrency level", "",
            "C client streams kept busy per level (GenerateStream, prompts cycled). agg tok/s: new tokens of "
            "all successful requests / wall time of the level; ms/token: "
            f"{load['ms_per_token_definition']}; TTFT: time to the first token, queueing included. Same tokens "
            "at every C: every request of one prompt got the same token ids at every level.", "",
            *load_table(load), "", *([f"Errors: {'; '.join(errors)}", ""] if errors else [])]


def pass_table(passes: Sequence[dict]) -> list[str]:
    """One row per (pass, method): speedup, tokens / step, ms / token, nodes / step, same output,
    and the proposers' shares of the accepted tokens."""
    lines = ["| pass | method | prompts | speedup vs incremental | tokens / step | ms / token | nodes / step "
             "| output = incremental | proposer shares |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in passes:
        shares = ", ".join(f"{name} {share:.0%}" for name, share in (r["proposer_share"] or {}).items()) or "-"
        match = "n/a" if r["outputs_match_incremental"] is None else f"{r['outputs_match_incremental']:.0%}"
        lines.append(f"| {r['pass']} | `{r['method']}` | {r['prompts']} | {_num(r['speedup_vs_incremental'])} "
                     f"| {_num(r['tokens_per_step'])} | {_num(r['ms_per_token'], 1)} | {_num(r['nodes_per_step'], 1)} "
                     f"| {match} | {shares} |")
    return lines


def write_outputs(out: Path, results: dict) -> list[Path]:
    """results.json, results.md and the PNG plots (skipped with a warning without matplotlib)."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plots = write_plots(out, results)
    write_markdown(out / "results.md", results, plots)
    return [out / "results.json", out / "results.md", *plots]


def machine_lines(machine: dict | None) -> list[str]:
    """One line naming the CPU, its native-bf16/AMX flags, the GPU and the commit, when recorded."""
    if not machine:
        return []
    isa = ", ".join(flag for flag, present in machine.get("isa", {}).items() if present) or "none recorded"
    cap = f", capped by {machine['isa_cap']}" if machine.get("isa_cap") else ""
    return [f"CPU {machine.get('cpu_model') or 'unknown'} ({isa}{cap}); GPU {machine.get('gpu') or 'none'}; "
            f"commit {machine.get('commit') or 'unknown'}."]


def write_markdown(path: Path, results: dict, plots: Sequence[Path] = ()) -> None:
    run, env = results["settings"], results["environment"]
    sampling = run["sampling"]
    decoding = "greedy" if not sampling["temperature"] else (
        f"temperature {sampling['temperature']}, top-p {sampling['top_p']}, top-k {sampling['top_k']}, "
        f"seed {sampling['seed']}")
    label = f" ({run['label']})" if run.get("label") else ""
    lines = [f"# Benchmark: {run['dataset']}{label}", "",
             f"`{run['config']}` ({run['dtype']}), {run['num_prompts']} prompts, up to {run['max_new_tokens']} new "
             f"tokens, {decoding}, {'gRPC ' + run['via'] if run['via'] else 'in-process'}; proposers "
             f"{', '.join(run['proposers']) or 'none'}, default schedule {run['expansion']}.",
             f"Machine: {env['processor']}, {env['cpu_count']} CPUs, torch {env['torch']}, "
             f"torch threads {env['torch_threads']}, transformers {env['transformers']}; {env['time']}.",
             *machine_lines(results.get("machine")), "",
             "Medians over prompts, p25-p75 in brackets. ms / token is wall time (prefill included) / new "
             "tokens; speedup is the median of per-prompt ratios to `incremental`"
             + (" (or `hf-assisted`)" if _compares_with_peer(results["summary"]) else "") + " on the same prompt.", "",
             *summary_table(results["summary"]), ""]
    profile = profile_table(results["summary"])
    if profile:
        lines += ["Step profile (sums over prompts / verify steps; drafting includes merge and transport):", "",
                  *profile, ""]
    if results.get("passes"):
        lines += ["Repeated prompts: each pass's medians (pass k asks every prompt again, after all of pass k-1):",
                  "", *pass_table(results["passes"]), ""]
    shares = proposer_table(results["summary"])
    if shares:
        lines += ["Share of accepted tokens credited to each proposer:", "", *shares, ""]
    lines += ["Outputs equal `incremental` token for token in float32; in bfloat16 (and when sampling) they may "
              "drift apart by rounding, so a match below 100% there is expected.", ""]
    if results.get("load"):
        lines += load_section(results["load"])
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install 'specinfer[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_panels(path: Path, methods: Sequence[str], panels: Sequence[tuple[str, dict[str, list[float]]]]) -> None:
    """One bar chart per panel, side by side: (y label, {series: a value per method}); several series
    in a panel are stacked (a legend names them). Nothing is drawn without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for axis, (label, series) in zip(axes[0], panels):
        bottom = [0.0] * len(methods)
        for name, values in series.items():
            axis.bar(methods, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.set_ylabel(label)
        axis.tick_params(axis="x", rotation=20)
        if len(series) > 1:
            axis.legend()
    _save(plt, fig, path)


def optional(value: float | None, spec: str = ".2f") -> str:
    """A table cell: ``value`` formatted, or a dash for None."""
    return "–" if value is None else format(value, spec)


def plot_speedup(plt, results: dict, path: Path) -> bool:
    data = {m: [r["speedup_vs_incremental"] for r in results["per_prompt"]
                if r["method"] == m and r["speedup_vs_incremental"] is not None] for m in results["summary"]}
    data = {m: v for m, v in data.items() if v}
    if not data:
        return False
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(data)), 4))
    ax.boxplot(list(data.values()), tick_labels=list(data), showfliers=True)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup vs incremental (per prompt)")
    ax.set_title(f"Speedup per method: {results['settings']['dataset']}")
    ax.tick_params(axis="x", labelrotation=20)
    _save(plt, fig, path)
    return True


def plot_accepted_lengths(plt, results: dict, path: Path) -> bool:
    """Fraction of verify steps that accepted L draft tokens, per speculative method."""
    data = {m: s["accepted_length_histogram"] for m, s in results["summary"].items()
            if s.get("accepted_length_histogram") and m != "incremental" and sum(s["accepted_length_histogram"])}
    if not data:
        return False
    longest = max(len(h) for h in data.values())
    width = 0.8 / len(data)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * longest * len(data) ** 0.5), 4))
    for index, (method, counts) in enumerate(data.items()):
        total = sum(counts)
        ax.bar([x + index * width for x in range(len(counts))], [c / total for c in counts], width, label=method)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(longest)], [str(x) for x in range(longest)])
    ax.set_xlabel("draft tokens accepted in one verify step")
    ax.set_ylabel("fraction of verify steps")
    ax.set_title("Accepted length per verify step")
    ax.legend(fontsize="small")
    _save(plt, fig, path)
    return True


def plot_acceptance_by_depth(plt, results: dict, path: Path) -> bool:
    """Fraction of verify steps whose accepted path reaches tree depth d."""
    data = {m: s["acceptance_by_depth"] for m, s in results["summary"].items() if s.get("acceptance_by_depth")}
    if not data:
        return False
    deepest = max(len(rates) for rates in data.values())
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, rates in data.items():  # depths no accepted token reached are 0
        ax.plot(range(1, deepest + 1), [*rates, *[0.0] * (deepest - len(rates))], marker="o", label=method)
    ax.set_xticks(range(1, deepest + 1))
    ax.set_xlabel("tree depth")
    ax.set_ylabel("fraction of verify steps accepting that depth")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by tree depth")
    ax.legend(fontsize="small")
    _save(plt, fig, path)
    return True


def plot_proposer_share(plt, results: dict, path: Path) -> bool:
    """Per method, the share of accepted tokens each proposer had proposed."""
    data = {m: s["proposer_share"] for m, s in results["summary"].items() if _drafted(s)}
    names = sorted({n for m in data for n in results["summary"][m]["proposers"]})
    if not data:
        return False
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(data)), 4))
    for index, name in enumerate(names):
        ax.bar([x + index * width for x in range(len(data))], [data[m].get(name, 0.0) for m in data], width,
               label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(data))], list(data), rotation=20)
    ax.set_ylabel("share of accepted tokens proposed")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-SSM contribution")
    ax.legend(fontsize="small")
    _save(plt, fig, path)
    return True


def plot_load(plt, results: dict, path: Path) -> bool:
    """Aggregate tokens/s and ms/token p50 against concurrency, one line per method."""
    load = results.get("load")
    if not load or not load["levels"]:
        return False
    fig, (rate_axis, latency_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in load["levels"]):
        rows = [r for r in load["levels"] if r["method"] == method]
        levels = [r["concurrency"] for r in rows]
        for axis, key in ((rate_axis, "aggregate_tokens_per_s"), (latency_axis, "ms_per_token_p50")):
            axis.plot(levels, [float("nan") if r[key] is None else r[key] for r in rows], marker="o", label=method)
    for axis, ylabel in ((rate_axis, "aggregate output tokens / s"), (latency_axis, "ms / token, p50")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(load["concurrency"], [str(c) for c in load["concurrency"]])
        axis.set_xlabel("concurrency (client streams)")
        axis.set_ylabel(ylabel)
        axis.set_ylim(0, axis.get_ylim()[1] * 1.1)  # from zero, with room above the highest point
        axis.legend(fontsize="small")
    label = f" ({load['label']})" if load["label"] else ""
    fig.suptitle(f"Load: {results['settings']['dataset']}{label}")
    _save(plt, fig, path)
    return True


def write_plots(out: Path, results: dict) -> list[Path]:
    """speedup.png, accepted_lengths.png, acceptance_by_depth.png, proposer_share.png and load.png
    (those with data)."""
    plt = _pyplot()
    if plt is None:
        return []
    drawers = {"speedup": plot_speedup, "accepted_lengths": plot_accepted_lengths,
               "acceptance_by_depth": plot_acceptance_by_depth, "proposer_share": plot_proposer_share,
               "load": plot_load}
    written = []
    for name in PLOTS:
        path = out / f"{name}.png"
        if drawers[name](plt, results, path):
            written.append(path)
    return written


# ----------------------------------------------------------------------------------------------
# Experiment


def experiment_markdown(rows: Sequence[dict], title: str, proposers: Sequence[str],
                        ensembles: Sequence[dict] = (), generation_hours: float | None = None) -> str:
    """One table over runs x datasets x SSM subsets x schedules (shares are of accepted tokens),
    then every ensemble against its best member (``bench.experiment.ensemble_verdicts``)."""
    lines = [f"# Experiment: {title}", "",
             "Medians over prompts; speedup is the median per-prompt ratio to `incremental` on the same prompt "
             "in the same run. A proposer's share is the fraction of accepted tokens it had proposed (a token "
             "several proposers proposed credits each, so shares may add up to more than 100%). Nodes, drafting "
             "and verify ms are per verify step over all prompts; drafting counts the SSMs, the merge and "
             "transport (served: the SSM actors draft concurrently).", "",
             "| run | dataset | SSMs | schedule | prompts | tokens / step | ms / token | speedup | output = incremental "
             "| nodes / step | drafting ms / step | verify ms / step | " + " | ".join(f"share {n}" for n in proposers) + " |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(proposers)]
    for r in rows:
        shares = r.get("proposer_share") or {}
        lines.append(
            f"| {r['run']} | {r['dataset']} | {', '.join(r['ssms']) or '(incremental)'} | {_schedule(r)} "
            f"| {r['prompts']} | {_num(r['tokens_per_step'])} | {_num(r['ms_per_token'], 1)} "
            f"| {_num(r['speedup_vs_incremental'])} | {_pct(r['outputs_match_incremental'])} "
            f"| {_num(r['nodes_per_step'], 1)} | {_num(r['draft_ms_per_step'], 0)} | {_num(r['verify_ms_per_step'], 0)} | "
            + " | ".join(_pct(shares.get(n, 0.0)) if n in r["ssms"] else "-" for n in proposers) + " |")
    if generation_hours is not None:
        lines += ["", f"Generation time: {generation_hours:.2f} h, the sum of every recorded generation's latency "
                      "over all sittings (warm-ups, model loading and server start-up not counted)."]
    return "\n".join(lines + ensemble_section(ensembles)) + "\n"


def _schedule(row: dict) -> str:
    return "-".join(map(str, row["schedule"])) or "-"


def _ratio(value: float | None, reference: float | None) -> str:
    return "n/a" if value is None or not reference else f"{value / reference:.2f}x"


def ensemble_section(ensembles: Sequence[dict]) -> list[str]:
    """Does a merged ensemble beat its best member, and why: its speedup is its tokens per step
    over its step time, so the ratios to the member's say which of the two moved."""
    if not ensembles:
        return []
    lines = ["", "## Ensembles against their best member", "",
             "The best member is the subset's proposer with the highest speedup alone (same run, dataset and "
             "schedule). The ratios are the ensemble's over the member's: tokens per step up means the merged "
             "tree was accepted further; drafting or verify ms per step up means each step cost more.", "",
             "| run | dataset | schedule | ensemble | best member | speedup | member speedup | beats it | "
             "tokens / step ratio | drafting ms ratio | verify ms ratio |",
             "|---|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for e in ensembles:
        mine, member = e["ensemble"], e["member"]
        ratios = " | ".join(_ratio(mine[key], member[key])
                            for key in ("tokens_per_step", "draft_ms_per_step", "verify_ms_per_step"))
        lines.append(
            f"| {mine['run']} | {mine['dataset']} | {_schedule(mine)} | {', '.join(mine['ssms'])} "
            f"| {member['ssms'][0]} | {_num(mine['speedup_vs_incremental'])} "
            f"| {_num(member['speedup_vs_incremental'])} | {'yes' if e['beats_best_member'] else 'no'} | {ratios} |")
    wins = sum(e["beats_best_member"] for e in ensembles)
    return lines + ["", f"{wins} of {len(ensembles)} ensembles beat their best member."]


def plot_ensembles(path: Path, ensembles: Sequence[dict]) -> bool:
    """Each ensemble's speedup beside its best member's, one panel per run and dataset."""
    plt = _pyplot()
    groups = sorted({(e["ensemble"]["run"], e["ensemble"]["dataset"]) for e in ensembles})
    if plt is None or not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6.0, 0.9 * len(ensembles) / len(groups)) * len(groups), 4.5),
                             squeeze=False)
    for axis, (run, dataset) in zip(axes[0], groups):
        pairs = [e for e in ensembles if (e["ensemble"]["run"], e["ensemble"]["dataset"]) == (run, dataset)]
        mine, members = [e["ensemble"] for e in pairs], [e["member"] for e in pairs]
        labels = [f"{'+'.join(r['ssms'])}\n{_schedule(r)}" for r in mine]
        x = list(range(len(mine)))
        axis.bar([i - 0.2 for i in x], [r["speedup_vs_incremental"] for r in members], 0.4, label="best member alone")
        axis.bar([i + 0.2 for i in x], [r["speedup_vs_incremental"] for r in mine], 0.4, label="ensemble")
        axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axis.set_xticks(x, labels, rotation=60, fontsize=7)
        axis.set_ylabel("speedup vs incremental")
        axis.set_title(f"{run}, {dataset}")
        axis.legend(fontsize=8)
    _save(plt, fig, path)
    return True


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"
