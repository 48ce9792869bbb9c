"""The target over a tensor-parallel ``RankGroup`` (DeepSpeed AutoTP ranks), two ways.

* ``TensorParallelTarget`` implements ``engine.target.Target``: one request per forward, each
  rank holding its shard of every request's DynamicCache (by state id). Every rank computes the
  same all-reduced logits; rank 0's come back, the caller verifies on them, and ``commit`` sends
  the one accepted path to every rank's cache shard.
* ``TensorParallelPagedModel`` is an ``engine.packed.PackedModel``: the continuous-batching
  forward over the ranks. The coordinator (this process) keeps the pool's accounting (block
  tables, free list, reservations: the ``BlockPool`` and each request's ``PagedSequence``) and
  packs every batch (``engine.packed.pack``); each rank holds its shard of the pool's storage
  (its key/value heads) and runs the ``PackedBatch`` it is sent. ``engine.paged_models.PagedTarget``
  runs on top of it unchanged.

A failed rank fails its call with ``RanksFailed`` and the group is rebuilt by the next call. For
the paged model the pool's storage epoch moves on at the same time: the old group's sequences keep
their blocks until their requests release them (so the accounting stays whole), and any forward
of one of them fails with ``StateLost`` on its own, without failing the requests it is batched with.
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass

import ray
import torch

from settings.config import EngineConfig
from engine.kv_pool import BlockPool
from engine.packed import ForwardItem, pack, per_item
from engine.target import ForwardsAlone
from engine.tree import TokenTree

from .rank_group import RankGroup, RanksFailed


@dataclass
class RemoteTargetState:
    """A request's state on the ranks: an id there, the cache length, and the group it lives in."""

    state_id: str
    generation: int
    length: int = 0
    dropper: weakref.finalize | None = None  # drops the ranks' shards once, on release or collection


class TensorParallelTarget(ForwardsAlone):
    """The target over ``tensor_parallel_size`` rank actors, one request per forward.

    ``model``: the target's ModelHeader (its configs; the weights live in the ranks).
    """

    def __init__(self, config: EngineConfig, model, name_prefix: str = "specinfer", namespace: str | None = None):
        self.config, self.model = config, model
        self.group = RankGroup(config, name_prefix, namespace)

    def new_state(self, reserve_tokens: int = 0) -> RemoteTargetState:
        """Each rank's DynamicCache grows as needed: nothing to reserve."""
        state = RemoteTargetState(uuid.uuid4().hex, self.group.ensure_started())
        state.dropper = weakref.finalize(state, self._drop, state.state_id, state.generation)
        return state

    def release(self, state: RemoteTargetState) -> None:
        state.dropper()

    def _drop(self, state_id: str, generation: int) -> None:
        with self.group.lock:
            if generation == self.group.generation:
                for rank in self.group.ranks:
                    rank.drop.remote(state_id)

    def prefill(self, state: RemoteTargetState, prompt_ids: list[int]) -> torch.Tensor:  # -> [V]
        logits = self.group.call(state.generation, "prefill", state.state_id, list(prompt_ids))
        state.length = len(prompt_ids)
        return logits

    def forward_tree(self, state: RemoteTargetState, tree: TokenTree) -> torch.Tensor:  # -> [N, V]
        return self.group.call(state.generation, "forward_tree", state.state_id, tree)

    def commit(self, state: RemoteTargetState, prefix_length: int, path: tuple[int, ...]) -> None:
        state.length = self.group.call(state.generation, "commit", state.state_id, prefix_length, tuple(path))

    def shutdown(self) -> None:
        """Kill every rank and free their resources (shared memory too)."""
        self.group.shutdown()


class TensorParallelPagedModel:
    """Packed forwards over the ranks: the pool's accounting here, its storage sharded on the ranks.

    Per forward one ``PackedBatch`` crosses to every rank (tokens, positions and write slots [T],
    per request its read slots [C], committed count and tree mask [n, C - committed], the rows
    [R] to keep, the commits' moves [2, W]); rank 0's logits [R, V] come back.
    """

    def __init__(self, config: EngineConfig, pool: BlockPool, name_prefix: str = "specinfer",
                 namespace: str | None = None):
        self.pool = pool
        self.group = RankGroup(config, name_prefix, namespace, pool_slots=pool.num_slots)

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | BaseException]:  # -> per item [r, V]
        with self.group.lock:  # packing (allocation, moves) in the order the ranks run batches
            generation = self.group.ensure_started()
            batch, errors = pack(items, self.pool)  # a lost sequence fails alone (StateLost)
            if batch is None:
                return per_item(None, batch, errors)
            refs = self.group.submit(generation, "run_packed", ray.put(batch))
        try:
            logits = self.group.collect(refs, generation, "run_packed")
        except RanksFailed:
            self.pool.lose_storage()  # every sequence of the old group is lost; blocks stay owned
            raise
        return per_item(logits, batch, errors)

    def shutdown(self) -> None:
        """Kill every rank and free their resources (shared memory too)."""
        self.group.shutdown()
