"""The engine loop on one GPU: S busy streams of planted requests, the tree against plain decoding.

    python bench/gpu_loop.py --shape qwen2.5-7b+0.5b --gate-ab --out $OUT/gpu_loop.json   # on a GPU machine
    python bench/gpu_loop.py --shape tiny --device cpu --dtype float32 --streams 1,2 --tokens 16 \\
        --prompt-tokens 32 --out /tmp/gpu_loop.json                                       # smoke test

What a served replica's loop runs, in one process: the target and the SSM over paged KV pools, one
packed target pass per iteration over every running request's tree and prompt chunks, one SSM
forward per tree level for the whole batch, the draft gate and cost-aware tree shapes priced by the
verify-cost curve measured at start, the tree budget from the same curve (as
``cluster.build.build_engine(config, batched=True)`` assembles them from a config). The models are
``gpu_prefetch.py``'s planted pair (random weights, a planted next-token rule; ``--agreement`` sets
how often the SSM's rule is the target's), so every request's output is known and every method must
produce it (``outputs_follow_the_target``). No tokenizer, no dataset, no Ray: the GPU machine has
torch and transformers only.

Per level (``--streams``): S busy streams, each sending ``--per-stream`` requests back to back
(``bench.loop_levels.measure_level``), the methods alternating within each of ``--repeats`` rounds
(``--gate-ab``: the tree also with the draft gate off, labelled "tree (no gate)").
Figures per level and method (``bench.loop_levels.summarise``): aggregate tokens per second and its
ratio against incremental, TTFT p50, tokens per target pass, draft and verify ms per decode
iteration, incremental's share of the forward limit (S tokens per pass at the curve's price).

Not in it (issue 41): CUDA graphs in the loop (its passes run eagerly; ``gpu_prefetch.py`` times the
one-request graphs) and the Ray actors' transport (the served executor, ``actors.executor``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import IdTokenizer, synchronize  # noqa: E402
from bench.gpu_prefetch import PlantedPair, add_pair_arguments, build_pair, follow, random_prompts  # noqa: E402
from bench.loop_levels import grouped, level_figures, markdown, measure_level, summarise, variants  # noqa: E402
from bench.machine import with_machine  # noqa: E402
from bench.workloads import EncodedPrompt, Prompt  # noqa: E402
from engine.budget import budget_from_curve, measure_target_curve  # noqa: E402
from engine.generate import SpeculativeEngine  # noqa: E402
from engine.loop import LoopLimits  # noqa: E402
from engine.paged_models import paged_drafter, paged_target  # noqa: E402
from engine.requests import SpeculationOptions  # noqa: E402
from engine.shape import TreeCost  # noqa: E402

# configs/default.yaml's speculation and server.tree_budget (settings.config needs pydantic, which
# the GPU machine lacks): the tree its users get, shaped by measured cost.
TREE = SpeculationOptions(mode="tree", expansion=(2, 1, 1, 1, 1, 1, 1), max_tree_nodes=64, min_confidence=0.3,
                          policy="cost")
METHODS = {"incremental": SpeculationOptions(mode="incremental"), "tree": TREE}
COST = {"beam": 4, "branch": 4, "max_depth": 16}
BUDGET_SLACK, MIN_TREE_NODES = 1.0, 2
TREE_ROOM = 256  # KV slots a request holds beyond its prompt and output: a tree's nodes, a draft's levels


class PlantedMethod(NamedTuple):
    """A method as ``measure_level`` reads it (``bench.loop_levels.LevelMethod``). A named tuple, not
    a dataclass: the tests load this script by path, outside ``sys.modules``."""

    spelling: str
    options: SpeculationOptions


def loop_engine(pair: PlantedPair, most: int, args: argparse.Namespace) -> tuple[SpeculativeEngine, dict]:
    """The batched engine over the pair for up to ``most`` running requests (as
    ``cluster.build.build_engine(config, batched=True)`` makes it), and its verify-cost curve (tokens
    per pass -> ms)."""
    slots = most * (args.prompt_tokens + args.tokens + TREE_ROOM)
    target = paged_target(pair.target, slots, args.block_size)
    drafter = paged_drafter(pair.ssm, 0, "ssm", slots, args.block_size, args.chunk_tokens)
    curve = measure_target_curve(target, args.curve_max_tokens, float("inf"))
    cost = TreeCost(tuple(sorted(curve.items())), COST["beam"], COST["branch"], COST["max_depth"])
    budget = budget_from_curve(curve, BUDGET_SLACK, MIN_TREE_NODES).per_request
    limits = LoopLimits(most, 4 * most, args.chunk_tokens)
    return SpeculativeEngine(target, [drafter], IdTokenizer(), set(), cost=cost, limits=limits,
                             tree_budget=budget), curve


def planted_prompts(pair: PlantedPair, count: int, tokens: int, seed: int) -> list[EncodedPrompt]:
    return [EncodedPrompt(Prompt(str(i), ""), tuple(ids))
            for i, ids in enumerate(random_prompts(pair.vocab_size, count, tokens, seed))]


def follows_the_target(level: dict, prompts: list[EncodedPrompt], rule: torch.Tensor, tokens: int) -> bool:
    """Every request of the level's first run emitted the target's rule from its prompt's last token
    (requests are numbered in submission order; the prompts are cycled)."""
    outputs = sorted(level["outputs"].items(), key=lambda item: int(item[0]))
    return all(out == follow(rule, prompts[i % len(prompts)].ids[-1], tokens) for i, (_, out) in enumerate(outputs))


def chosen_methods(spellings: str, policy: str) -> list[PlantedMethod]:
    """Incremental first (the ratios' base), then the others named, their trees shaped by ``policy``.
    Example: "tree" -> incremental, tree."""
    names = ["incremental"] + [m for m in spellings.split(",") if m != "incremental"]
    return [PlantedMethod(m, replace(METHODS[m], policy=policy)) for m in names]


def run(args: argparse.Namespace) -> dict:
    streams = [int(s) for s in args.streams.split(",")]
    pair = build_pair(args, args.seed)
    engine, curve = loop_engine(pair, max(streams), args)
    prompts = planted_prompts(pair, max(streams) * args.per_stream, args.prompt_tokens, args.seed + 3)
    methods = chosen_methods(args.methods, args.policy)
    for method in methods:  # warm-up, not recorded: kernels, the allocator, the largest batch's shapes
        measure_level(engine, method, prompts, max(streams), 4)
    levels, exact = [], True
    for level in streams:
        synchronize(args.device)
        runs = [measure_level(engine, method, prompts, level, args.tokens, gated, args.per_stream)
                for _ in range(args.repeats) for method, gated in variants(methods, args.gate_ab)]
        figures = [level_figures(group) for group in grouped(runs)]
        exact &= all(follows_the_target(f, prompts, pair.target_rule, args.tokens) for f in figures)
        print(", ".join(f"{level} streams: {f['method']} {f['aggregate_tokens_per_s']:.1f} tok/s" for f in figures),
              flush=True)
        levels += figures
    rows = summarise(levels, curve)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {"device": device, "shape": args.shape, "dtype": args.dtype, "agreement": args.agreement,
            "settings": {k: str(v) for k, v in vars(args).items()}, "curve": curve,
            "outputs_follow_the_target": exact, "levels": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_arguments(parser, tokens=128)
    parser.add_argument("--streams", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--methods", default="incremental,tree",
                        help=f"comma-separated, of {sorted(METHODS)}; incremental always runs (the ratios' base)")
    parser.add_argument("--policy", choices=["cost", "schedule"], default="cost",
                        help="tree shapes by measured cost (the default config's) or by the expansion schedule")
    parser.add_argument("--gate-ab", action="store_true",
                        help="also run the tree with the draft gate off (\"tree (no gate)\"), right after it")
    parser.add_argument("--per-stream", type=int, default=2, help="requests each stream sends back to back")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per level, every method once a round")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="prompt tokens one target pass takes")
    parser.add_argument("--curve-max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or args.per_stream < 1 or args.repeats < 1:
        parser.error(f"--methods of {sorted(METHODS)} (unknown: {sorted(unknown)}), --per-stream and --repeats >= 1")
    began = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - began
    args.out.write_text(json.dumps(with_machine(result), indent=1))
    print(f"{result['device']}, {args.shape}, {args.dtype}, agreement {args.agreement}; every output is the "
          f"target's own: {result['outputs_follow_the_target']}; {result['wall_s']:.0f} s")
    print(markdown(result["levels"]))
    return result


if __name__ == "__main__":
    main()
