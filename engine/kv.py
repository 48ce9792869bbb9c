"""KV-cache helpers over transformers' DynamicCache (layers hold keys/values [B, H, P, D])."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache


@lru_cache(maxsize=None)
def _cache_parameter(model_class: type) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (deprecated alias until 5.40)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_argument(model, cache: DynamicCache) -> dict:
    """The keyword argument that passes ``cache`` to ``model``'s forward."""
    return {_cache_parameter(type(model)): cache}


def activation_dtype(model) -> torch.dtype:
    """The dtype ``model``'s hidden states, keys, values and attention biases are in: that of its
    last floating-point parameter (the final norm or the output head).

    ``model.dtype`` reads the first one, the input embedding table, which is not always the
    compute dtype: ``engine.models.quantize_int8`` keeps a bf16 table (widened per lookup) while
    its int8 linears and norms compute in float32. Worked examples: a bf16 model -> bfloat16;
    a float32 one -> float32; int8 quantized from bf16 -> float32 (table bf16, final norm float32).
    """
    return [p for p in model.parameters() if p.is_floating_point()][-1].dtype


def new_cache() -> DynamicCache:
    """An empty cache whose every layer keeps every entry (``DynamicLayer``s, made on first use).

    Not ``DynamicCache(config=...)``: for a sliding-window model that makes sliding layers which
    drop the entries older than the window, and then index i of a layer no longer holds position i,
    which commits (``keep_path``) and tree masks rely on. Windows are applied by the masks instead
    (``engine.masks``), so the cache is full attention's, window or not.
    """
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or after ``length`` (a view: nothing is copied)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_path(cache: DynamicCache, prefix_length: int, path: list[int]) -> None:
    """Keep the prefix plus the tree nodes on ``path`` (indices relative to the prefix).

    The tree's N entries were appended after ``prefix_length``; afterwards the cache holds
    ``prefix_length + len(path)`` entries. Nodes already in place are not moved, so a path
    that is a run 0, 1, 2, ... (the first branch of a DFS-ordered tree) costs one crop.

    Example: prefix_length 10, path [0, 3, 4] -> entries 10, 13, 14 move to 10, 11, 12.
    """
    moved = [i for i, node in enumerate(path) if node != i]
    if moved:
        first = moved[0]
        source = torch.tensor(path[first:], device=cache.layers[0].keys.device) + prefix_length
        target = slice(prefix_length + first, prefix_length + len(path))
        for layer in cache.layers:
            layer.keys[..., target, :] = layer.keys[..., source, :]
            layer.values[..., target, :] = layer.values[..., source, :]
    crop(cache, prefix_length + len(path))


def tail(cache: DynamicCache, start: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Copies of every layer's entries from ``start`` on: (keys, values) per layer, [B, H, P - start, D]."""
    return tuple((layer.keys[..., start:, :].clone(), layer.values[..., start:, :].clone()) for layer in cache.layers)


def append_rows(cache: DynamicCache, entries: tuple[tuple[torch.Tensor, torch.Tensor], ...], rows: list[int]) -> None:
    """Append the ``rows`` of saved entries (from ``tail``) after the cached ones, in that order.

    Example: 10 cached entries, 5 saved, rows [0, 2] -> 12 entries: saved rows 0 and 2 at 10 and 11.
    """
    index = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer, (keys, values) in zip(cache.layers, entries):
        layer.keys = torch.cat([layer.keys, keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values, values.index_select(-2, index)], dim=-2)


def restore_tail(cache: DynamicCache, start: int, entries: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> None:
    """Crop to ``start`` and append ``entries`` (from ``tail``): the cache holds what it held when
    ``tail`` copied them, value for value."""
    crop(cache, start)
    for layer, (keys, values) in zip(cache.layers, entries):
        layer.keys = torch.cat([layer.keys, keys], dim=-2)
        layer.values = torch.cat([layer.values, values], dim=-2)
