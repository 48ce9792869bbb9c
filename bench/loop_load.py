"""Load levels on the in-process engine loop: S requests at once, every method, one process.

    python -m bench.loop_load --config configs/default.yaml --dataset sharegpt --streams 1,4,8 \\
        --methods incremental,tree --num-prompts 8 --max-new-tokens 64 --out bench/results/loop-load

For each level S and each method (the methods alternate within a level, so a slow stretch of the
machine falls on both), S requests (the workload's prompts cycled) are submitted to the batched
in-process engine (``cluster.build.build_engine(config, batched=True)``: paged pools, one packed
target pass per iteration, one SSM forward per tree level for the whole batch) and the loop is
stepped until all have finished. No Ray, no gRPC: what the loop itself does under load.

Figures per (method, level), written to ``OUT/loop_load.json`` and ``OUT/loop_load.md``:

* ``aggregate_tokens_per_s``: every request's new tokens / the level's wall time;
* ``ttft_ms_p50``: from submission to the request's first token;
* ``tokens_per_pass``: new tokens per target pass (one per iteration);
* ``forward_limit_tokens_per_s`` (incremental): S tokens per pass at the measured verify-cost of an
  S-token pass, the most plain decoding could reach; ``of_limit``: incremental's share of it;
* ``phase_ms``: an iteration's mean ms per phase (schedule, draft and merge, verify, commit) and the
  mean running requests: where the time goes.

The ratio against incremental is the level's aggregate tokens per second over incremental's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Sequence

from engine.loop import IterationStats
from engine.requests import GenerationRequest
from settings.config import load_config

from .methods import BASELINE, Method, resolve_methods
from .run import environment, load_tokenizer
from .workloads import EncodedPrompt, load_workload

logger = logging.getLogger(__name__)


def run_level(engine, method: Method, workload: Sequence[EncodedPrompt], streams: int, max_new_tokens: int) -> dict:
    """S requests submitted at once; the loop stepped until every one has finished."""
    loop, seen = engine.loop, []
    loop.observers.append(seen.append)
    try:
        began = time.perf_counter()
        ids = [loop.submit(GenerationRequest(workload[i % len(workload)].ids, max_new_tokens,
                                             speculation=method.options)) for i in range(streams)]
        first, tokens, outputs = {}, dict.fromkeys(ids, 0), {i: [] for i in ids}
        while loop.has_work:
            loop.step()
            for request_id in ids:
                if request_id not in loop.requests:
                    continue
                for update in loop.take(request_id):
                    if update.token_ids and request_id not in first:
                        first[request_id] = (time.perf_counter() - began) * 1e3
                    tokens[request_id] += len(update.token_ids)
                    outputs[request_id].extend(update.token_ids)
        wall_s = time.perf_counter() - began
    finally:
        loop.observers.remove(seen.append)
    return level_figures(method.spelling, streams, wall_s, tokens, first, seen, outputs)


def level_figures(method: str, streams: int, wall_s: float, tokens: dict, first: dict,
                  iterations: Sequence[IterationStats], outputs: dict) -> dict:
    total = sum(tokens.values())
    phases = {phase: statistics.fmean(s.ms[phase] for s in iterations) for phase in iterations[0].ms}
    return {"method": method, "streams": streams, "wall_s": wall_s, "new_tokens": total,
            "aggregate_tokens_per_s": total / wall_s, "ttft_ms_p50": statistics.median(first.values()),
            "iterations": len(iterations), "tokens_per_pass": total / len(iterations),
            "drafted_per_iteration": statistics.fmean(s.drafted_tokens for s in iterations),
            "running_mean": statistics.fmean(s.running for s in iterations),
            "phase_ms": phases, "outputs": {str(k): v for k, v in outputs.items()}}


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
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| streams | method | tok/s | vs incremental | TTFT p50 ms | tokens/pass | running | draft ms | "
             "verify ms | of forward limit |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        limit = f"{r['of_limit']:.2f}" if r.get("of_limit") else ""
        lines.append(f"| {r['streams']} | {r['method']} | {r['aggregate_tokens_per_s']:.2f} | {r['vs_incremental']:.2f} "
                     f"| {r['ttft_ms_p50']:.0f} | {r['tokens_per_pass']:.2f} | {r['running_mean']:.1f} | "
                     f"{r['phase_ms']['draft']:.0f} | {r['phase_ms']['verify']:.0f} | {limit} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--streams", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--methods", default="incremental,tree")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.build import build_engine, close_engine

    config = load_config(args.config, dtype=args.dtype)
    streams = [int(s) for s in args.streams.split(",")]
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"max_concurrent_requests": max(streams)})})
    methods = resolve_methods(args.methods.split(","), config)
    workload = load_workload(args.dataset, load_tokenizer(config), args.num_prompts)
    engine = build_engine(config, batched=True)
    curve = dict(engine.cost.verify_ms) if engine.cost is not None else None
    try:
        for method in methods:  # warm-up, not recorded: the largest level's shapes (prompt chunks, batches)
            run_level(engine, method, workload, max(streams), 4)
        levels = [run_level(engine, method, workload, s, args.max_new_tokens) for s in streams for method in methods]
    finally:
        close_engine(engine)
    rows = summarise(levels, curve)
    result = {"environment": environment(), "settings": vars(args) | {"out": str(args.out)}, "curve": curve,
              "levels": rows, "outputs": [{"method": l["method"], "streams": l["streams"], "outputs": l["outputs"]}
                                          for l in levels]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loop_load.json").write_text(json.dumps(result, indent=1))
    (args.out / "loop_load.md").write_text(markdown(rows))
    print(markdown(rows))
    return result


if __name__ == "__main__":
    main()
