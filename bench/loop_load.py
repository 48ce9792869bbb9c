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
from pathlib import Path
from typing import Sequence

from engine.budget import measure_target_curve
from settings.config import load_config

from .loop_levels import grouped, level_figures, markdown, measure_level, summarise, variants
from .methods import Method, resolve_methods
from .machine import machine
from .run import environment, load_tokenizer
from .workloads import EncodedPrompt, load_workload

logger = logging.getLogger(__name__)


def run_level(engine, method: Method, workload: Sequence[EncodedPrompt], streams: int, max_new_tokens: int,
              gated: bool = True) -> dict:
    """One run of a level, summarised (``level_figures``)."""
    return level_figures([measure_level(engine, method, workload, streams, max_new_tokens, gated)])


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


def mean_curve(before: dict[int, float] | None, after: dict[int, float] | None) -> dict[int, float] | None:
    """The verify-cost curve measured before the levels and again after them, averaged per size
    (a 2-core box drifts over a run); the sizes both have. {1: 200, 8: 300} and {1: 220, 8: 340} ->
    {1: 210, 8: 320}."""
    if not before or not after:
        return before or after or None
    return {size: (before[size] + after[size]) / 2 for size in before if size in after}


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
