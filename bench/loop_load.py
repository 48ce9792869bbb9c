"""Load levels on the in-process engine loop: S requests at once (or S busy streams), every method.

    python -m bench.loop_load --config configs/default.yaml --dataset sharegpt --streams 1,4,8 \\
        --methods incremental,tree --num-prompts 8 --max-new-tokens 64 --out bench/results/loop-load

For each level S and each method (the methods alternate within a level, so a slow stretch of the
machine falls on both), S requests (the workload's prompts cycled) are submitted to the batched
in-process engine (``cluster.build.build_engine(config, batched=True)``: paged pools, one packed
target pass per iteration, one SSM forward per tree level for the whole batch) and the loop is
stepped until all have finished. With ``--per-stream K`` the level is S busy streams instead: each
sends its next request when one finishes, K x S requests in all (a closed batch of S equal-length
requests favours plain decoding, which keeps all S in every pass to the end, while a tree finishes
some early). No Ray, no gRPC: what the loop itself does under load.

With ``--repeats R`` each level runs R rounds, every method once a round, and a method's figures
pool its rounds (tokens per second: all their tokens over all their wall time; seconds, tokens and
iterations summed, ``runs_tokens_per_s`` each round's own): on a 2-core box one run of a level
varies by up to 10%, as much as the differences measured.

Figures per (method, level), written to ``OUT/loop_load.json`` and ``OUT/loop_load.md``:

* ``aggregate_tokens_per_s``: every request's new tokens / the level's wall time;
* ``ttft_ms_p50``: from submission to the request's first token;
* ``tokens_per_pass``: new tokens per target pass (one per iteration);
* ``drafted_per_iteration``, ``drafts_per_iteration``: drafted tokens, and requests whose tree had
  any, per iteration (how much the draft gate let draft);
* ``forward_limit_tokens_per_s`` (incremental): S tokens per pass at the measured verify-cost of an
  S-token pass, the most plain decoding could reach; ``of_limit``: incremental's share of it;
  ``decode_of_limit``: the same share for the decode iterations alone (their tokens per second
  against the limit at their mean tokens per pass), so that the prompts' passes are not counted;
* ``profile``: the prefill iterations (a pass that fed prompt chunks) and the decode ones apart:
  count, seconds, tokens, ms per phase (see ``split_profile``);
* ``phase_ms``: an iteration's mean ms per phase (schedule, draft and merge, verify, commit) and the
  mean running requests: where the time goes.

The ratio against incremental is the level's aggregate tokens per second over incremental's.
The engine's draft gate (``engine.draft_gate``: how many requests draft is measured, per load)
persists across the levels, as in a server; ``--gate-ab`` also runs every speculative method with
the gate off, labelled "METHOD (no gate)", interleaved with the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engine.budget import measure_target_curve
from engine.loop import PHASES, IterationStats
from engine.requests import GenerationRequest
from settings.config import load_config

from .methods import BASELINE, Method, resolve_methods
from .machine import machine
from .run import environment, load_tokenizer
from .workloads import EncodedPrompt, load_workload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelRun:
    """One run of a level, as measured: its label, wall time, and per request its new tokens, ms to
    its first token and its output; the loop's iterations."""

    method: str
    streams: int
    wall_s: float
    tokens: dict
    first: dict
    iterations: list
    outputs: dict


def run_level(engine, method: Method, workload: Sequence[EncodedPrompt], streams: int, max_new_tokens: int,
              gated: bool = True) -> dict:
    """One run of a level, summarised (``level_figures``)."""
    return level_figures([measure_level(engine, method, workload, streams, max_new_tokens, gated)])


def measure_level(engine, method: Method, workload: Sequence[EncodedPrompt], streams: int, max_new_tokens: int,
                  gated: bool = True, per_stream: int = 1) -> LevelRun:
    """S busy streams: S requests submitted at once and, as each finishes, the stream's next, until
    ``per_stream`` x S requests (the workload's prompts cycled) have finished; the loop stepped
    meanwhile. ``gated``: with the engine's draft gate (it persists across levels, as in a server),
    else with none. The first token's ms count from the request's submission."""
    loop, seen, gate = engine.loop, [], engine.loop.gate
    loop.gate = gate if gated else None
    loop.observers.append(seen.append)
    prompts = [workload[i % len(workload)].ids for i in range(streams * per_stream)]
    try:
        began, submitted, first, tokens, outputs = time.perf_counter(), {}, {}, {}, {}

        def submit() -> None:
            request_id = loop.submit(GenerationRequest(prompts[len(submitted)], max_new_tokens,
                                                       speculation=method.options))
            submitted[request_id], tokens[request_id], outputs[request_id] = time.perf_counter(), 0, []
        for _ in range(streams):
            submit()
        while loop.has_work:
            loop.step()
            for request_id in [i for i in submitted if i in loop.requests]:
                for update in loop.take(request_id):
                    if update.token_ids and request_id not in first:
                        first[request_id] = (time.perf_counter() - submitted[request_id]) * 1e3
                    tokens[request_id] += len(update.token_ids)
                    outputs[request_id].extend(update.token_ids)
                    if update.finish_reason is not None and len(submitted) < len(prompts):
                        submit()
        wall_s = time.perf_counter() - began
    finally:
        loop.observers.remove(seen.append)
        loop.gate = gate
    label = method.spelling if gated or method.spelling == BASELINE else f"{method.spelling} (no gate)"
    return LevelRun(label, streams, wall_s, tokens, first, seen, outputs)


def run_levels(engine, methods: Sequence[Method], workload: Sequence[EncodedPrompt], streams: Sequence[int],
               args: argparse.Namespace) -> list[dict]:
    """Every level's figures: per level ``args.repeats`` rounds, each running every variant once (so
    a slow stretch of the machine falls on all of them), the rounds pooled per variant."""
    figures = []
    for level in streams:
        runs = [measure_level(engine, method, workload, level, args.max_new_tokens, gated, args.per_stream)
                for _ in range(args.repeats) for method, gated in variants(methods, args.gate_ab)]
        these = [level_figures(group) for group in grouped(runs)]
        logger.info("level %d: %s", level, ", ".join(f"{f['method']} {f['aggregate_tokens_per_s']:.1f} tok/s"
                                                       for f in these))
        figures += these
    return figures


def variants(methods: Sequence[Method], gate_ab: bool) -> list[tuple[Method, bool]]:
    """(method, gated) runs per level: each method with the gate; with ``gate_ab`` every method but
    the baseline without it too, right after it."""
    return [(m, gated) for m in methods for gated in ((True, False) if gate_ab and m.spelling != BASELINE else (True,))]


def grouped(runs: Sequence[LevelRun]) -> list[list[LevelRun]]:
    """The runs of each (method, level), in the order first met."""
    groups: dict[tuple[str, int], list[LevelRun]] = {}
    for run in runs:
        groups.setdefault((run.method, run.streams), []).append(run)
    return list(groups.values())


def pooled(group: Sequence[LevelRun]) -> LevelRun:
    """Runs of one (method, level) as one: wall times, tokens, first tokens and iterations together
    (requests keyed by (run, id)); the first run's outputs."""
    return LevelRun(group[0].method, group[0].streams, sum(r.wall_s for r in group),
                    {(i, k): v for i, r in enumerate(group) for k, v in r.tokens.items()},
                    {(i, k): v for i, r in enumerate(group) for k, v in r.first.items()},
                    [s for r in group for s in r.iterations], group[0].outputs)


def level_figures(runs: Sequence[LevelRun]) -> dict:
    """A level's figures over its repeated runs (one method) pooled: tokens per second is every
    run's tokens over every run's wall time; ``runs_tokens_per_s``: each run's own."""
    run = pooled(runs)
    total, iterations = sum(run.tokens.values()), run.iterations
    return {"method": run.method, "streams": run.streams, "wall_s": run.wall_s, "new_tokens": total,
            "repeats": len(runs), "runs_tokens_per_s": [sum(r.tokens.values()) / r.wall_s for r in runs],
            "aggregate_tokens_per_s": total / run.wall_s, "ttft_ms_p50": statistics.median(run.first.values()),
            "iterations": len(iterations), "tokens_per_pass": total / len(iterations),
            "drafted_per_iteration": statistics.fmean(s.drafted_tokens for s in iterations),
            "drafts_per_iteration": statistics.fmean(s.drafts for s in iterations),
            "running_mean": statistics.fmean(s.running for s in iterations),
            "phase_ms": phase_means(iterations), "profile": split_profile(iterations),
            "outputs": {str(k): v for k, v in run.outputs.items()}}


def phase_means(iterations: Sequence[IterationStats]) -> dict[str, float]:
    """Mean ms per phase of an iteration (zeros for none)."""
    return {phase: statistics.fmean(s.ms[phase] for s in iterations) if iterations else 0.0 for phase in PHASES}


def split_profile(iterations: Sequence[IterationStats]) -> dict:
    """Where a level's time goes: the iterations whose pass fed prompt chunks (``prefill``) and the
    others (``decode``), each with its count, seconds, tokens emitted, mean running requests and mean
    ms per phase; decode's tokens per second. Example: two decode iterations of 300 ms emitting 8
    tokens each and one prefill of 1,200 ms -> decode 2 iterations, 0.6 s, 16 tokens, 26.7 tok/s."""
    profile = {}
    for part, chosen in (("prefill", [s for s in iterations if s.prompt_tokens]),
                         ("decode", [s for s in iterations if not s.prompt_tokens])):
        seconds = sum(sum(s.ms.values()) for s in chosen) / 1e3
        emitted = sum(s.emitted_tokens for s in chosen)
        profile[part] = {"iterations": len(chosen), "seconds": seconds, "emitted_tokens": emitted,
                         "running_mean": statistics.fmean(s.running for s in chosen) if chosen else 0.0,
                         "phase_ms": phase_means(chosen)}
    decode = profile["decode"]
    decode["tokens_per_s"] = decode["emitted_tokens"] / decode["seconds"] if decode["seconds"] else None
    return profile


def forward_limit(curve: dict[int, float] | None, streams: int) -> float | None:
    """Tokens per second of plain decoding at ``streams`` requests: S tokens per pass at the curve's
    cost of an S-token pass (linear between measured sizes); None past the curve or without one.
    Example: {1: 200, 8: 320}, 4 streams -> 4 / 0.2514 s = 15.9."""
    if not curve:
        return None
    sizes = sorted(curve)
    if streams in curve:
        return streams * 1e3 / curve[streams]
    below = [s for s in sizes if s < streams]
    above = [s for s in sizes if s > streams]
    if not below or not above:
        return None
    lo, hi = below[-1], above[0]
    ms = curve[lo] + (curve[hi] - curve[lo]) * (streams - lo) / (hi - lo)
    return streams * 1e3 / ms


def mean_curve(before: dict[int, float] | None, after: dict[int, float] | None) -> dict[int, float] | None:
    """The verify-cost curve measured before the levels and again after them, averaged per size
    (a 2-core box drifts over a run); the sizes both have. {1: 200, 8: 300} and {1: 220, 8: 340} ->
    {1: 210, 8: 320}."""
    if not before or not after:
        return before or after or None
    return {size: (before[size] + after[size]) / 2 for size in before if size in after}


def summarise(levels: list[dict], curve: dict[int, float] | None) -> list[dict]:
    """Per level: each method's figures and its ratio against incremental's aggregate tokens/s."""
    rows = []
    for level in levels:
        base = next((l for l in levels if l["streams"] == level["streams"] and l["method"] == BASELINE), None)
        row = {k: v for k, v in level.items() if k != "outputs"}
        row["vs_incremental"] = level["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"] if base else None
        if level["method"] == BASELINE:
            limit = forward_limit(curve, level["streams"])
            row["forward_limit_tokens_per_s"] = limit
            row["of_limit"] = level["aggregate_tokens_per_s"] / limit if limit else None
            decode = level["profile"]["decode"]  # incremental: one token per request in a pass
            batch = decode["emitted_tokens"] / decode["iterations"] if decode["iterations"] else None
            decode_limit = forward_limit(curve, batch) if batch else None
            row["decode_of_limit"] = decode["tokens_per_s"] / decode_limit if decode_limit else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| streams | method | tok/s | vs incremental | TTFT p50 ms | tokens/pass | prefill s | decode tok/s | "
             "decode draft ms | decode verify ms | of forward limit | decode of limit |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        prefill, decode = r["profile"]["prefill"], r["profile"]["decode"]
        share = lambda key: f"{r[key]:.2f}" if r.get(key) else ""  # noqa: E731
        lines.append(f"| {r['streams']} | {r['method']} | {r['aggregate_tokens_per_s']:.2f} | {r['vs_incremental']:.2f} "
                     f"| {r['ttft_ms_p50']:.0f} | {r['tokens_per_pass']:.2f} | {prefill['seconds'] / r['repeats']:.1f} | "
                     f"{decode['tokens_per_s'] or 0:.2f} | {decode['phase_ms']['draft']:.0f} | "
                     f"{decode['phase_ms']['verify']:.0f} | {share('of_limit')} | {share('decode_of_limit')} |")
    return "\n".join(lines) + "\n"


def level_config(config, most_streams: int, disable_above_running: int | None):
    """The config a run uses: every level's requests running at once (``max_concurrent_requests``:
    the largest level), and ``disable_above_running`` where given."""
    server = {"max_concurrent_requests": most_streams}
    if disable_above_running is not None:
        server["tree_budget"] = config.server.tree_budget.model_copy(update={"disable_above_running": disable_above_running})
    return config.model_copy(update={"server": config.server.model_copy(update=server)})


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--streams", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--methods", default="incremental,tree")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--disable-above-running", type=int, default=None,
                        help="server.tree_budget.disable_above_running for this run (plain decoding above it)")
    parser.add_argument("--gate-ab", action="store_true",
                        help="also run each speculative method with the draft gate off (\"METHOD (no gate)\")")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per level, every method once a round; figures pool the rounds")
    parser.add_argument("--per-stream", type=int, default=1,
                        help="requests each stream runs back to back (S x this per level; 1: one closed batch)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.per_stream < 1:
        parser.error(f"--per-stream must be >= 1, got {args.per_stream}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.build import build_engine, close_engine

    config = load_config(args.config, dtype=args.dtype)
    streams = [int(s) for s in args.streams.split(",")]
    config = level_config(config, max(streams), args.disable_above_running)
    methods = resolve_methods(args.methods.split(","), config)
    workload = load_workload(args.dataset, load_tokenizer(config), args.num_prompts)
    engine = build_engine(config, batched=True)
    before = dict(engine.cost.verify_ms) if engine.cost is not None else None
    try:
        for method in methods:  # warm-up, not recorded: the largest level's shapes (prompt chunks, batches)
            run_level(engine, method, workload, max(streams), 4)
        levels = run_levels(engine, methods, workload, streams, args)
        after = measure_target_curve(engine.target, max(before), float("inf")) if before else None
    finally:
        close_engine(engine)
    curve = mean_curve(before, after)
    rows = summarise(levels, curve)
    result = {"environment": environment(), "machine": machine(), "settings": vars(args) | {"out": str(args.out)},
              "curve": curve, "curve_before": before, "curve_after": after,
              "levels": rows, "outputs": [{"method": l["method"], "streams": l["streams"], "outputs": l["outputs"]}
                                          for l in levels]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loop_load.json").write_text(json.dumps(result, indent=1))
    (args.out / "loop_load.md").write_text(markdown(rows))
    print(markdown(rows))
    return result


if __name__ == "__main__":
    main()
