"""Paged KV pool with packed multi-request forwards vs one DynamicCache per request.

    python bench/experiments/paged_vs_padded.py --config configs/default.yaml \
        --out bench/results/batching/paged_vs_padded.json

For the config's target: (1) the verify-cost curve of one packed forward (ms vs tree tokens in
the pass, on a 256-token prefix): the curve the serving tree budget is derived from; (2) one
verify step of B requests (a 4-node tree each, mixed prefixes 96-288) three ways: B separate
DynamicCache forwards, one batched forward over a padded [B, max prefix] DynamicCache, and one
packed forward over the paged pool; (3) the KV memory each layout holds for those requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.loading import load_configured  # noqa: E402
from cluster.build import set_threads  # noqa: E402
from settings.config import load_config  # noqa: E402
from engine import kv  # noqa: E402
from engine.paged_models import time_packed_forward  # noqa: E402
from engine.budget import budget_from_curve  # noqa: E402
from engine.kv_pool import BlockPool, PagedSequence  # noqa: E402
from engine.packed import ForwardItem, PagedModel, chain_item  # noqa: E402
from engine.target import TargetModel  # noqa: E402
from engine.timing import median_ms  # noqa: E402
from engine.tree import TokenTree, ancestor_mask, positions  # noqa: E402
from bench.machine import with_machine  # noqa: E402

TREE = TokenTree(torch.tensor([11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1]))



def padded_step(target: TargetModel, prefixes: list[int], repeats: int) -> tuple[float, int]:
    """B DynamicCache forwards (one per request); returns (ms, KV bytes held)."""
    states = []
    for prefix in prefixes:
        state = target.new_state()
        target.prefill(state, list(range(100, 100 + prefix)))
        states.append(state)

    def step() -> None:
        for state, prefix in zip(states, prefixes):
            target.forward_tree(state, TREE)
            kv.crop(state.cache, prefix)

    ms = median_ms(step, repeats)
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for s in states for layer in s.cache.layers)
    return ms, held


def padded_batch_step(model, prefixes: list[int], repeats: int) -> tuple[float, int]:
    """The padded alternative: one batched forward over a [B, H, max prefix, D] DynamicCache
    (shorter prefixes padded to the longest, padding masked); returns (ms, KV bytes held)."""
    from transformers import DynamicCache

    batch, longest = len(prefixes), max(prefixes)
    cache = DynamicCache(config=model.config)
    ids = torch.full((batch, longest), 100, dtype=torch.long)
    with torch.inference_mode():
        model(input_ids=ids, **kv.cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    bias = torch.zeros(batch, 1, TREE.size, longest + TREE.size, dtype=model.dtype)
    for row, prefix in enumerate(prefixes):
        bias[row, :, :, prefix:longest] = torch.finfo(model.dtype).min  # the padding
        bias[row, 0, :, longest:].masked_fill_(~ancestor_mask(TREE.parents), torch.finfo(model.dtype).min)
    position_ids = torch.stack([positions(TREE.parents, p) for p in prefixes])

    @torch.inference_mode()
    def step() -> None:
        model(input_ids=TREE.tokens.repeat(batch, 1), attention_mask=bias, position_ids=position_ids,
              **kv.cache_argument(model, cache), use_cache=True)
        kv.crop(cache, longest)

    ms = median_ms(step, repeats)
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return ms, held


def paged_step(paged: PagedModel, prefixes: list[int], repeats: int) -> tuple[float, int]:
    """One packed forward over B requests; returns (ms, KV bytes of the blocks they hold)."""
    sequences = []
    for prefix in prefixes:
        sequence = PagedSequence(paged.pool)
        paged.forward([chain_item(sequence, list(range(100, 100 + prefix)))])
        sequence.keep(list(range(prefix)))
        sequences.append(sequence)

    def step() -> None:
        items = [ForwardItem(s, TREE.tokens, positions(TREE.parents, s.length), ancestor_mask(TREE.parents),
                             torch.arange(TREE.size)) for s in sequences]
        paged.forward(items)
        for sequence in sequences:
            sequence.truncate(sequence.length)

    ms = median_ms(step, repeats)
    per_slot = sum(k.element_size() * k[:, 0].numel() * 2 for k in paged.runner.storage.keys)
    held = sum(len(s.blocks) for s in sequences) * paged.pool.block_size * per_slot
    for sequence in sequences:
        sequence.release()
    return ms, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slack", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("bench/out/paged_vs_padded.json"))
    args = parser.parse_args()
    config = load_config(args.config)
    set_threads(config.torch_threads)
    model = load_configured(config, config.target).model
    target = TargetModel(model)
    paged = PagedModel(model, BlockPool.for_tokens(8192, 16))
    curve = {size: time_packed_forward(paged, size, repeats=args.repeats) for size in (1, 2, 4, 8, 16, 32, 64)}
    print("verify-cost curve (packed forward, 256 prefix):", {k: round(v) for k, v in curve.items()}, flush=True)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prefixes = [96 + 64 * (i % 4) for i in range(batch)]  # mixed prompt lengths
        separate_ms, separate_bytes = padded_step(target, prefixes, args.repeats)
        padded_ms, padded_bytes = padded_batch_step(model, prefixes, args.repeats)
        paged_ms, paged_bytes = paged_step(paged, prefixes, args.repeats)
        rows.append({"requests": batch, "prefixes": prefixes, "separate_ms": separate_ms, "padded_batch_ms": padded_ms,
                     "paged_ms": paged_ms, "separate_kv_mib": separate_bytes / 2**20,
                     "padded_batch_kv_mib": padded_bytes / 2**20, "paged_kv_mib": paged_bytes / 2**20})
        print(rows[-1], flush=True)
    budget = budget_from_curve(curve, args.slack)
    result = {"config": args.config, "dtype": config.dtype, "threads": torch.get_num_threads(), "tree": "4 nodes",
              "verify_cost_ms": curve, "budget_cap": budget.cap, "slack": args.slack, "step": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_machine(result), indent=2))


if __name__ == "__main__":
    main()
