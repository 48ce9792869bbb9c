"""The TTFT floor of a burst: how soon prompts that arrive together can have their first tokens.

    python bench/ttft_floor.py --config configs/serve.yaml --dataset sharegpt --num-prompts 8 \
        --out bench/out/ttft-floor.json

The load benchmark's top level sends its C prompts at once. A first token needs its whole prompt
through the target, so the k-th first token of the burst cannot come before the target has run the
k shortest prompts: at least the cheapest way to run those tokens, which is one packed forward over
all of them or one forward per prompt, whichever the measurement finds cheaper (passes here cost
less per token the more tokens they hold, so mixed splits lie between). With T(k) that bound, the
burst's TTFT percentiles are at least those of T(1), ..., T(C), with nothing else running: no decode
steps of earlier requests, no SSM prefill on the same cores, no gRPC or streaming hops. Compare it
with the TTFT the load benchmark measured at that concurrency.

The forwards are the served verifier's: packed passes on a paged pool (``engine.packed.PagedModel``),
the configured dtype and threads, each the median of ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from actors.loading import load_configured
from bench.workloads import load_workload
from cluster.build import set_threads
from engine.kv_pool import BlockPool, PagedSequence
from engine.packed import PagedModel, chain_item
from engine.paged_models import forward_or_raise
from engine.timing import median_ms
from settings.config import load_config
from bench.machine import with_machine


def time_prefill(model: PagedModel, prompts: list[list[int]], repeats: int) -> float:
    """Median ms of one packed forward prefilling every prompt (each its own sequence)."""

    def prefill() -> None:
        sequences = [PagedSequence(model.pool) for _ in prompts]
        try:
            forward_or_raise(model, [chain_item(s, ids) for s, ids in zip(sequences, prompts)])
        finally:
            for sequence in sequences:
                sequence.release()

    return median_ms(prefill, repeats)


def burst_floor(packed_ms: list[float], alone_ms: list[float]) -> list[float]:
    """T(k): the k shortest prompts in one packed pass or one by one, whichever is cheaper.
    ``packed_ms[k - 1]``: the pass over the k shortest; ``alone_ms``: each prompt alone, shortest first.
    Example: packed [100, 150, 260], alone [100, 120, 130] -> [100, 150, 260] (one by one: 220, 350)."""
    return [min(packed, sum(alone_ms[:k])) for k, packed in enumerate(packed_ms, start=1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/serve.yaml")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=8, help="the burst: the workload's first prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/ttft-floor.json"))
    args = parser.parse_args()
    config = load_config(args.config)
    set_threads(config.torch_threads)
    loaded = load_configured(config, config.target)
    workload = load_workload(args.dataset, loaded.tokenizer, args.num_prompts)
    prompts = sorted((list(p.ids) for p in workload), key=len)
    model = PagedModel(loaded.model, BlockPool.for_tokens(sum(map(len, prompts)) + 256, 16))
    alone = [time_prefill(model, [ids], args.repeats) for ids in prompts]
    packed = [time_prefill(model, prompts[:k], args.repeats) for k in range(1, len(prompts) + 1)]
    floor = burst_floor(packed, alone)
    p50, p95 = np.percentile(floor, [50, 95])
    result = {"config": args.config, "dataset": args.dataset, "dtype": config.dtype, "threads": torch.get_num_threads(),
              "prompt_tokens": [len(ids) for ids in prompts], "alone_ms": alone, "packed_shortest_k_ms": packed,
              "floor_ms": floor, "ttft_floor_p50_ms": float(p50), "ttft_floor_p95_ms": float(p95)}
    print(json.dumps({k: v if not isinstance(v, list) else [round(x, 1) for x in v] for k, v in result.items()}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(result), indent=2))


if __name__ == "__main__":
    main()
