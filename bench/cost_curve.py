"""Measure forward cost vs tokens per pass for the target and the SSMs of a config.

    python bench/cost_curve.py --config configs/default.yaml --out bench/out/cost_curve.json

For each model: the median time of one forward of N tree tokens on top of a P-token prefix
(N = 1 is a plain decode step). This is the curve that decides how large a tree pays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import get_args

import torch

from actors.loading import load_configured
from cluster.build import set_threads
from settings.config import CpuLinears, load_config
from engine import kv
from engine.target import TargetModel
from engine.timing import median_ms
from engine.tree import TokenTree
from bench.machine import with_machine


def chain_tree(size: int) -> TokenTree:
    tokens = torch.randint(100, 1000, (size,))
    return TokenTree(tokens, torch.arange(-1, size - 1))


def time_forward(model, prefix: int, size: int, repeats: int) -> float:
    """Median ms of one forward of ``size`` tree tokens after a ``prefix``-token prefill."""
    target = TargetModel(model)
    state = target.new_state()
    target.prefill(state, torch.randint(100, 1000, (prefix,)).tolist())

    def run() -> None:
        target.forward_tree(state, chain_tree(size))
        kv.crop(state.cache, prefix)  # a view of the cache: nothing copied

    return median_ms(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cpu-linears", choices=get_args(CpuLinears), default=None,
                        help="linear layers on CPU (the config's cpu_linears)")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/out/cost_curve.json"))
    args = parser.parse_args()
    config = load_config(args.config, dtype=args.dtype, cpu_linears=args.cpu_linears)
    set_threads(config.torch_threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {"config": args.config, "dtype": config.dtype, "cpu_linears": config.cpu_linears, "prefix": args.prefix,
               "threads": torch.get_num_threads(),
               "models": {}}
    for model_config in [config.target, *config.ssms]:
        model = load_configured(config, model_config).model
        curve = {size: time_forward(model, args.prefix, size, args.repeats) for size in sizes}
        results["models"][model_config.name] = curve
        print(model_config.name, {k: round(v, 1) for k, v in curve.items()}, flush=True)
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(results), indent=2))


if __name__ == "__main__":
    main()
