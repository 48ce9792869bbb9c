"""Write BENCHMARKS.md from bench/benchmarks_template.md and the result files it cites.

Every figure in BENCHMARKS.md comes from a file under bench/results: the template's prose holds
placeholders, never numbers, and this module fills them:

* ``{{headline}}``: the latest result per workload x machine x method of ``HEADLINE_RUNS``;
* ``{{v FILE | PATH | FORMAT}}``: one value of ``FILE``; ``PATH`` is keys joined by ``>``, a list
  index, or ``key=value`` (the first list item whose ``key`` equals ``value``);
* ``{{ratio FILE | METHOD | BASELINE}}``: the per-prompt median ratio (``RATIO``) in ``FILE``;
* ``{{table NAME | FILE | FILE...}}``: one of ``TABLES``.

``python -m bench.benchmarks_md`` rewrites BENCHMARKS.md; ``--check`` exits 1 when it differs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
TEMPLATE = ROOT / "bench" / "benchmarks_template.md"
OUTPUT = ROOT / "BENCHMARKS.md"
RATIO = ("the median over prompts of (baseline ms/token / method ms/token), each prompt's pair from the "
         "same run")
# The main comparison's runs; the headline keeps the newest per workload x machine x method.
HEADLINE_RUNS = (
    "packed-bf16-amx/humaneval-20x128", "packed-bf16-amx/sharegpt-20x128", "packed-bf16-amx/humaneval-grpc-10x128",
    "bf16-amx/humaneval-20x128", "bf16-amx/sharegpt-20x128",
    "humaneval-bf16-reuse-20x128", "sharegpt-bf16-reuse-20x128", "humaneval-bf16-20x128", "sharegpt-bf16-20x128",
)
METHOD_ORDER = ("incremental", "sequence:4", "tree", "ensemble", "hf-assisted")
MACHINE_NAMES = {"amx-xeon": "AMX Xeon", "avx512-bf16-epyc": "AVX512-BF16 EPYC", "avx2-epyc": "AVX2 EPYC",
                 "h200": "H200"}
PLACEHOLDER = re.compile(r"\{\{(headline|v|ratio|table)(?: ([^}]*))?\}\}")


CITED: set[str] = set()  # every file load() has been asked for since cited_files() last cleared it


@lru_cache(maxsize=None)
def _read(file: str) -> dict:
    return json.loads((ROOT / RESULTS / file).read_text())


def load(file: str) -> dict:
    """The result file ``bench/results/FILE`` (JSON), noted as cited."""
    CITED.add(file)
    return _read(file)


def link(file: str) -> str:
    """A markdown link to ``file``, relative to the repository root (BENCHMARKS.md's folder)."""
    return f"[{file}]({RESULTS}/{file})"


def lookup(data, path: str):
    """The value at ``path`` (``a>b>0>method=tree&concurrency=8>x``) inside ``data``."""
    for part in path.split(">"):
        part = part.strip()
        if isinstance(data, list) and "=" in part:
            wanted = [condition.partition("=")[::2] for condition in part.split("&")]
            data = next(item for item in data if all(str(item.get(k)) == v for k, v in wanted))
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            data = data[part]
    return data


def ms_per_token(row: dict) -> float:
    """A generation's wall time (prefill included) / new tokens: its own figure, or from its latency."""
    return row["ms_per_token"] if "ms_per_token" in row else row["latency_ms"] / row["new_tokens"]


def per_prompt_rows(data: dict) -> list[dict]:
    """A result file's one-row-per-generation list (``per_prompt`` of a bench run, else ``rows``)."""
    return data["per_prompt"] if "per_prompt" in data else data["rows"]


def per_prompt_ratio(rows: list[dict], method: str, baseline: str) -> float | None:
    """``RATIO`` of ``method`` against ``baseline`` over the prompts both ran; None when none did."""
    by_prompt: dict[str, dict[str, float]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_id"], {})[row["method"]] = ms_per_token(row)
    ratios = [times[baseline] / times[method] for times in by_prompt.values()
              if times.get(method) and times.get(baseline)]
    return statistics.median(ratios) if ratios else None


def machine_name(record: dict | None) -> str:
    """A short name for a result's ``machine`` record."""
    if not record or record.get("recorded") == "unknown":
        return "unknown"
    if record.get("name"):
        return MACHINE_NAMES.get(record["name"], record["name"])
    if record.get("gpu"):
        return record["gpu"]
    isa = record.get("isa") or {}
    kind = "AMX" if isa.get("amx_bf16") else "AVX512-BF16" if isa.get("avx512_bf16") else \
        "AVX2" if isa.get("avx2") else "no AVX2"
    name = f"{kind} {record.get('cpu_model') or 'CPU'}"
    return f"{name} capped by {record['isa_cap']}" if record.get("isa_cap") else name


def fmt(value, spec: str = ".2f") -> str:
    """``value`` formatted, ``-`` for a missing one."""
    return "-" if value is None else format(value, spec)


def table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    """A markdown table; columns from ``numeric_from`` on are right-aligned, except a ``file`` column."""
    align = ["---" if i < numeric_from or name == "file" else "---:" for i, name in enumerate(header)]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def workload_name(settings: dict) -> str:
    """``HumanEval 20 x 128, in-process`` from a run's ``settings``."""
    dataset = {"humaneval": "HumanEval", "sharegpt": "ShareGPT"}.get(settings["dataset"], settings["dataset"])
    where = "served (gRPC)" if settings.get("via") else "in-process"
    return f"{dataset} {settings['num_prompts']} x {settings['max_new_tokens']}, {where}"


def ratios(file: str, method: str) -> list[str]:
    """``method``'s per-prompt median ratio against incremental, sequence:4 and hf-assisted in ``file``."""
    rows = load(file)["per_prompt"]
    return [fmt(per_prompt_ratio(rows, method, base)) for base in ("incremental", "sequence:4", "hf-assisted")]


def headline_rows(runs: tuple[str, ...] = HEADLINE_RUNS) -> list[tuple[tuple, str]]:
    """((workload, machine, method), file) for the newest run of each workload x machine x method."""
    newest: dict[tuple, tuple[str, str]] = {}
    for run in runs:
        file = f"{run}/results.json"
        data = load(file)
        key = (workload_name(data["settings"]), machine_name(data.get("machine")))
        for method in data["summary"]:
            if method in METHOD_ORDER and newest.get((*key, method), ("", ""))[0] < data["environment"]["time"]:
                newest[(*key, method)] = (data["environment"]["time"], file)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(((k, f) for k, (_, f) in newest.items()), key=lambda kf: (kf[0][0], kf[0][1], order[kf[0][2]]))


def headline() -> str:
    """The one-screen table: tokens/step, ms/token and the three ratios per workload x machine x method."""
    rows = []
    for (workload, machine, method), file in headline_rows():
        summary = load(file)["summary"][method]
        rows.append([workload, machine, f"`{method}`", fmt(summary["tokens_per_step"]),
                     fmt(summary["ms_per_token"], ".1f"), *ratios(file, method), link(file.rsplit("/", 1)[0])])
    return table(["workload", "machine", "method", "tokens / step", "ms / token", "vs incremental",
                  "vs sequence:4", "vs HF assisted", "file"], rows, numeric_from=3)


def methods_table(file: str) -> str:
    """Every method of one run: tokens/step, ms/token, the ratios, outputs equal to incremental's."""
    summary = load(file)["summary"]
    rows = [[f"`{m}`", fmt(s["tokens_per_step"]), fmt(s["ms_per_token"], ".1f"), *ratios(file, m),
             fmt(100 * s["outputs_match_incremental"], ".0f") + "%"] for m, s in summary.items()]
    return table(["method", "tokens / step", "ms / token", "vs incremental", "vs sequence:4", "vs HF assisted",
                  "output = incremental"], rows)


def load_table(*files: str) -> str:
    """Tree against incremental per concurrency level, served with batching, one row per file x level."""
    rows = []
    for file in files:
        levels = load(file)["load"]["levels"]
        for level in (lv for lv in levels if lv["method"] == "tree"):
            plain = next(lv for lv in levels if lv["method"] == "incremental"
                         and lv["concurrency"] == level["concurrency"])
            rows.append([link(file.rsplit("/", 1)[0]), str(level["concurrency"]),
                         fmt(level["aggregate_tokens_per_s"], ".1f"), fmt(plain["aggregate_tokens_per_s"], ".1f"),
                         fmt(level["aggregate_tokens_per_s"] / plain["aggregate_tokens_per_s"]),
                         fmt(level["ttft_ms_p50"], ".0f"), fmt(level["tree_nodes_mean"], ".1f")])
    return table(["run", "streams", "tree tok/s", "incremental tok/s", "tree / incremental tok/s", "tree TTFT p50 ms",
                  "tree nodes / step"], rows)


def loop_load_table(*files: str) -> str:
    """The in-process engine loop under load (``bench/loop_load.py``): each level and method, its
    ratio against incremental's tok/s, and where the time goes: the prompts' passes (prefill
    seconds of the level's wall) and an iteration of decoding (its drafting and verify ms)."""
    rows = []
    for file in files:
        for level in load(file)["levels"]:
            prefill, decode = level["profile"]["prefill"], level["profile"]["decode"]
            share = lambda key: fmt(level[key]) if level.get(key) else ""  # noqa: E731
            runs = level.get("repeats", 1)  # seconds per run: the rounds of a level are pooled
            rows.append([str(level["streams"]), f"`{level['method']}`", fmt(level["aggregate_tokens_per_s"], ".1f"),
                         fmt(level["vs_incremental"]), fmt(level["ttft_ms_p50"], ".0f"),
                         fmt(level["tokens_per_pass"]), f"{prefill['seconds'] / runs:.1f} of {level['wall_s'] / runs:.1f}",
                         fmt(decode["tokens_per_s"], ".1f"), fmt(decode["phase_ms"]["draft"], ".0f"),
                         fmt(decode["phase_ms"]["verify"], ".0f"), share("of_limit"), share("decode_of_limit"),
                         link(file)])
    return table(["streams", "method", "tok/s", "vs incremental tok/s", "TTFT p50 ms", "tokens / pass",
                  "prefill s of wall s (a run)", "decode tok/s", "decode: draft ms / iteration",
                  "decode: verify ms / iteration", "of the forward limit", "decode: of the limit", "file"], rows)


def gpu_sizes_table(*files: str) -> str:
    """Tree against plain decoding over CUDA graphs, one row per target shape."""
    rows = []
    for file in files:
        data = load(file)
        plain, tree = (lookup(data, f"table>method={m}, graphs") for m in ("incremental", "tree"))
        rows.append([data["shape"], fmt(plain["decode_tokens_per_s"], ".1f"), fmt(tree["decode_tokens_per_s"], ".1f"),
                     fmt(tree["decode_tokens_per_s"] / plain["decode_tokens_per_s"]), fmt(plain["step_ms"], ".1f"),
                     f"{tree['draft_wait_ms']:.1f} + {tree['verify_ms']:.1f}", fmt(tree["tokens_per_step"]),
                     link(file)])
    return table(["target + SSM shape", "plain decode tok/s", "tree decode tok/s", "tree / plain tok/s",
                  "plain step ms", "tree drafting + verify ms", "tokens / step", "file"], rows)


def ensembles_table(file: str) -> str:
    """Per run x dataset: the best configuration, and how many ensembles beat their best member."""
    data = load(file)
    rows = []
    for run, dataset in dict.fromkeys((r["run"], r["dataset"]) for r in data["rows"]):
        group = [r for r in data["rows"] if (r["run"], r["dataset"]) == (run, dataset)]
        best = max(group, key=lambda r: r["speedup_vs_incremental"])
        verdicts = [e["beats_best_member"] for e in data["ensembles"]
                    if (e["ensemble"]["run"], e["ensemble"]["dataset"]) == (run, dataset)]
        rows.append([run, dataset, f"`{best['method']}`", fmt(best["speedup_vs_incremental"]),
                     fmt(best["tokens_per_step"]), f"{sum(verdicts)} of {len(verdicts)}"])
    return table(["run", "dataset", "best configuration", "vs incremental", "tokens / step",
                  "ensembles beating their best member"], rows, numeric_from=3)


def cost_table(*files: str) -> str:
    """The target's forward ms against tokens per pass, one row per cost-curve file."""
    sizes = list(next(iter(load(files[0])["models"].values())))
    rows = []
    for file in files:
        data = load(file)
        curve = next(iter(data["models"].values()))
        rows.append([f"`{data.get('cpu_linears', '-')}`", *(fmt(curve[s], ".0f") for s in sizes), link(file)])
    return table(["cpu_linears", *sizes, "file"], rows)


def ab_table(*files: str) -> str:
    """Two linear-kernel settings in one process, prompt by prompt (bench/linears_ab.py)."""
    rows = []
    for file in files:
        data = load(file)
        old, new = data["settings"]
        for method, s in data["summary"].items():
            rows.append([data["dataset"], f"`{method}`", f"{s[f'{old}_ms_per_token']} -> {s[f'{new}_ms_per_token']}",
                         fmt(s["ratio_median"]), f"{s[f'{new}_faster_prompts']} of {s['prompts']}",
                         f"{s[f'{old}_tokens_per_step']} -> {s[f'{new}_tokens_per_step']}", link(file)])
    return table(["dataset", "method", "ms / token, first -> second setting", "second faster, per-prompt median",
                  "prompts won", "tokens / step", "file"], rows, numeric_from=2)


def passes_table(file: str) -> str:
    """Repeated prompts: each pass's medians per method."""
    rows = [[str(p["pass"]), f"`{p['method']}`", fmt(p["tokens_per_step"]), fmt(p["ms_per_token"], ".1f"),
             fmt(p["speedup_vs_incremental"])] for p in load(file)["passes"]]
    return table(["pass", "method", "tokens / step", "ms / token", "vs incremental"], rows, numeric_from=2)


def memory_table(file: str) -> str:
    """Each serving process's memory (MB), ready and after the streams."""
    data = load(file)
    after = data["memory_mb_after"]
    rows = [[f"`{name}`", fmt(ready["VmRSS"], ".0f"), fmt(after[name]["VmRSS"], ".0f"), fmt(ready["RssAnon"], ".0f"),
             fmt(ready["RssFile"], ".0f"), fmt(after[name]["VmHWM"], ".0f")]
            for name, ready in data["memory_mb_ready"].items()]
    return table(["process", "RSS ready", "RSS after", "anonymous (ready)", "file-mapped (ready)", "peak (VmHWM)"],
                 rows)


def shard_load_table(*files: str) -> str:
    """Loading a target by shard (bench/shard_load.py): each process's load time and peak RSS."""
    rows = []
    for file in files:
        data = load(file)
        for p in data["processes"]:
            read = fmt(p["bytes_read"] / 1e9) if "bytes_read" in p else "-"
            rows.append([f"`{data['source']}` {data['dtype']}", p["process"], fmt(p["weights_mb"], ".0f"),
                         fmt(p["peak_rss_mb_loaded"], ".0f"), fmt(p.get("peak_vs_whole")), read, fmt(p["load_s"], ".1f")])
    return table(["target", "process", "weights MB", "peak RSS MB", "vs whole", "GB read", "load s"], rows,
                 numeric_from=2)


TABLES: dict[str, Callable[..., str]] = {
    "methods": methods_table, "load": load_table, "loop_load": loop_load_table, "gpu_sizes": gpu_sizes_table,
    "ensembles": ensembles_table,
    "cost": cost_table, "ab": ab_table, "passes": passes_table, "memory": memory_table,
    "shard_load": shard_load_table,
}


def fill(match: re.Match) -> str:
    """The text one placeholder stands for."""
    kind, args = match.group(1), [a.strip() for a in (match.group(2) or "").split("|")]
    if kind == "headline":
        return headline()
    if kind == "v":
        file, path, *spec = args
        return fmt(lookup(load(file), path), spec[0] if spec else ".2f")
    if kind == "ratio":
        file, method, baseline = args
        return fmt(per_prompt_ratio(per_prompt_rows(load(file)), method, baseline)) + "x"
    name, *files = args
    return TABLES[name](*files)


def reflow(block: str, width: int = 100) -> str:
    """A prose paragraph or bullet list rewrapped to ``width``; tables, headings and comments as they are."""
    if block.startswith(("|", "#", "<!--", "```")):
        return block
    items = re.split(r"\n(?=\* )", block)
    return "\n".join(textwrap.fill(" ".join(item.split()), width, subsequent_indent="  " if item.startswith("* ")
                                    else "", break_long_words=False, break_on_hyphens=False) for item in items)


def render(template: str) -> str:
    """BENCHMARKS.md's text: ``template`` with every placeholder filled from its result file."""
    body = PLACEHOLDER.sub(fill, template.replace("{{ratio_definition}}", RATIO))
    if "{{" in body:
        raise ValueError(f"unknown placeholder: {body[body.index('{{'):body.index('{{') + 60]!r}")
    return "\n\n".join(reflow(block) for block in body.strip("\n").split("\n\n")) + "\n"


def cited_files(template: str) -> set[str]:
    """The result files (relative to bench/results) the rendered document reads."""
    CITED.clear()
    render(template)
    return set(CITED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when BENCHMARKS.md differs from the files")
    args = parser.parse_args(argv)
    text = render(TEMPLATE.read_text())
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        print("BENCHMARKS.md is up to date" if current == text else "BENCHMARKS.md differs: run python -m "
              "bench.benchmarks_md")
        return 0 if current == text else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
