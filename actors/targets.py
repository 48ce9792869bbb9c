"""What the verifier runs as its target, and the pool + batcher of any batched model.

``build_target`` chooses from the config (``load_target``: the unbatched rows, which the
in-process engine of ``cluster.build`` uses too):

    tensor_parallel_size  batching  target
    1                     off       TargetModel: a DynamicCache per request
    1                     on        PagedTarget over a PagedModel: pool accounting and storage here
    N                     off       TensorParallelTarget: DynamicCache shards on N rank actors
    N                     on        PagedTarget over a TensorParallelPagedModel: the pool's accounting
                                    here, its storage sharded over the N ranks (their KV heads)
"""

from __future__ import annotations

from typing import Callable

import ray

from settings.config import EngineConfig
from engine.batcher import BatchWaits, ForwardBatcher
from engine.kv_pool import BlockPool, heads_per_shard
from engine.models import LoadedModel, check_tensor_parallel, load_header
from engine.packed import PackedModel
from engine.paged_models import PagedTarget, paged_parts
from engine.target import Target, TargetModel

from .loading import load_configured, model_spec
from .tensor_parallel import TensorParallelPagedModel, TensorParallelTarget


def batch_waits(config: EngineConfig, burst: bool = True) -> BatchWaits:
    """The configured waits of a packed forward for other requests' calls and, with ``burst`` (the
    verifier: a prompt's prefill there gives its first token), for a burst of prompts."""
    b = config.server.batching
    return BatchWaits(b.window_ms / 1e3, b.window_fraction, b.burst_ms / 1e3 if burst else 0.0, b.burst_max_ms / 1e3)


def batcher_for(config: EngineConfig, model: PackedModel, expected: Callable[[], int]) -> ForwardBatcher:
    """A batcher over ``model`` with the configured waits and prefill chunk."""
    return ForwardBatcher(model, batch_waits(config), expected, config.server.batching.prefill_chunk_tokens)


def batching_parts(config: EngineConfig, model, expected: Callable[[], int],
                   scale: float = 1.0, burst: bool = True) -> tuple[BlockPool, ForwardBatcher]:
    """The pool (``kv_cache_tokens`` x ``scale`` token slots) and batcher for one model in this process
    (``burst``: see ``batch_waits``; an SSM's prompt prefill is not on the first token's path)."""
    b = config.server.batching
    return paged_parts(model, int(b.kv_cache_tokens * scale), b.block_size, batch_waits(config, burst), expected,
                       b.prefill_chunk_tokens)


def check_shardable(model_config, tensor_parallel_size: int) -> None:
    """Each rank holds whole key/value heads of the pool: the head count must split evenly."""
    try:
        heads_per_shard(model_config, tensor_parallel_size)
    except ValueError as error:
        raise ValueError(f"verifier.tensor_parallel_size {tensor_parallel_size} with batching: {error}; use a "
                         "divisor of the head count or server.batching.enabled: false") from None


def load_target(config: EngineConfig, name_prefix: str = "specinfer",
                namespace: str | None = None) -> tuple[Target, LoadedModel]:
    """The unbatched target and a LoadedModel for its tokenizer and configs.

    With ``verifier.tensor_parallel_size`` > 1 the weights load in rank actors, so Ray must be
    initialised (the verifier actor runs in Ray; ``cluster.build.build_engine`` starts it); this
    process then loads the tokenizer and configs only (the LoadedModel's model is a header).
    """
    if config.verifier.tensor_parallel_size == 1:
        loaded = load_configured(config, config.target)
        return TargetModel(loaded.model), loaded
    if not ray.is_initialized():
        raise RuntimeError("a tensor-parallel target needs Ray: start or join a Ray cluster first")
    header = load_header(model_spec(config, config.target))
    check_tensor_parallel(header.model.config, config.target.name, config.verifier.tensor_parallel_size)
    return TensorParallelTarget(config, header.model, name_prefix, namespace), header


def build_target(config: EngineConfig, expected: Callable[[], int], name_prefix: str = "specinfer",
                 namespace: str | None = None) -> tuple[Target, LoadedModel]:
    """The target and the LoadedModel for its tokenizer and configs (a ModelHeader without weights
    in this process under tensor parallelism; Ray must then be initialised). ``expected()``: how
    many requests may submit a forward soon (the batcher waits for them)."""
    tp = config.verifier.tensor_parallel_size
    if not config.server.batching.enabled:
        return load_target(config, name_prefix, namespace)
    if tp == 1:
        loaded = load_configured(config, config.target)
        pool, batcher = batching_parts(config, loaded.model, expected)
        return PagedTarget(loaded.model, pool, batcher), loaded
    header = load_header(model_spec(config, config.target))
    check_tensor_parallel(header.model.config, config.target.name, tp)
    check_shardable(header.model.config, tp)
    batching = config.server.batching
    pool = BlockPool.for_tokens(batching.kv_cache_tokens, batching.block_size)
    model = TensorParallelPagedModel(config, pool, name_prefix, namespace)
    return PagedTarget(header.model, pool, batcher_for(config, model, expected)), header
