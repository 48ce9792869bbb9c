"""The target model side: prefill, one forward over a whole tree, commit of the accepted path.

``Target`` is the one interface every target implements with the same signatures: the plain
``TargetModel`` here (a DynamicCache per request), ``PagedTarget`` (``engine.paged_models``: a
block table in a shared pool, forwards batched across requests, run in this process or over
tensor-parallel ranks) and ``TensorParallelTarget`` (``actors.tensor_parallel``: DeepSpeed AutoTP
ranks, one request per forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from . import kv
from .masks import forward_masks
from .programs import Program, alone
from .tree import TokenTree, ancestor_mask, positions

if TYPE_CHECKING:
    from transformers import DynamicCache


class TargetStateLike(Protocol):
    """A request's state on a target: ``length`` tokens are in its KV cache (the root is not)."""

    @property
    def length(self) -> int: ...


@runtime_checkable
class Target(Protocol):
    """What the speculative step needs from a target. Calls on one state come one at a time."""

    def new_state(self, reserve_tokens: int = 0) -> TargetStateLike:
        """A fresh request state; ``reserve_tokens`` is promised memory where a pool exists
        (raises ``engine.kv_pool.PoolExhausted`` when it cannot be promised)."""

    def prefill(self, state: TargetStateLike, prompt_ids: list[int]) -> torch.Tensor:  # -> [V]
        """Run the prompt into the state's cache; the logits of the first new token."""

    def forward_tree(self, state: TargetStateLike, tree: TokenTree) -> torch.Tensor:  # -> [N, V]
        """One forward over the whole tree (positions prefix + depth, tree mask)."""

    def prefill_program(self, state: TargetStateLike, prompt_ids: list[int], chunk_tokens: int | None = None) -> Program:
        """``prefill`` as a forward program (``engine.programs``), in chunks where the target packs
        forwards (``chunk_tokens`` prompt tokens each; None: one); returns the logits [V]."""

    def tree_program(self, state: TargetStateLike, tree: TokenTree) -> Program:
        """``forward_tree`` as a forward program: returns the logits [N, V]."""

    def commit(self, state: TargetStateLike, prefix_length: int, path: tuple[int, ...]) -> None:
        """Keep the prefix plus the accepted path (root included); drop the other tree entries."""

    def release(self, state: TargetStateLike) -> None:
        """Give the state's memory back (idempotent)."""

    def shutdown(self) -> None:
        """Free what the target holds beyond its states (processes, shared memory)."""


@dataclass
class TargetState:
    """Per-request target state: the KV cache holds every committed token but the root."""

    cache: DynamicCache

    @property
    def length(self) -> int:
        return kv.cache_length(self.cache)


class ForwardsAlone:
    """The forward programs of a target whose forwards run one request at a time: each program's
    forward is its ``prefill`` / ``forward_tree`` call, run by itself (``engine.programs.ALONE``)."""

    def prefill_program(self, state, prompt_ids: list[int], chunk_tokens: int | None = None) -> Program:  # -> [V]
        return (yield alone(lambda: self.prefill(state, prompt_ids)))

    def tree_program(self, state, tree: TokenTree) -> Program:  # -> [N, V]
        return (yield alone(lambda: self.forward_tree(state, tree)))


class TargetModel(ForwardsAlone):
    def __init__(self, model):
        self.model = model
        self.dtype = kv.activation_dtype(model)  # its masks' dtype (read once: it walks every parameter)

    def new_state(self, reserve_tokens: int = 0) -> TargetState:
        """A DynamicCache grows as needed: nothing to reserve."""
        return TargetState(kv.new_cache())

    def release(self, state: TargetState) -> None:
        """Nothing to give back: a DynamicCache is freed with its state."""

    def shutdown(self) -> None:
        """Nothing beyond the model, which the caller owns."""

    @torch.inference_mode()
    def prefill(self, state: TargetState, prompt_ids: list[int]) -> torch.Tensor:  # -> [V]
        """Run the prompt; return the logits for the first new token."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, **kv.cache_argument(self.model, state.cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def forward_tree(self, state: TargetState, tree: TokenTree) -> torch.Tensor:  # -> [N, V]
        """One forward over all tree nodes: positions prefix + depth, each node sees its
        ancestors and itself (within the sliding window on windowed layers). The tree's KV entries
        are appended until ``commit``."""
        prefix = state.length
        device = self.model.device
        places = positions(tree.parents, prefix)  # [N]
        masks = forward_masks(self.model.config, ancestor_mask(tree.parents), prefix, places, places, self.dtype, device)
        out = self.model(
            input_ids=tree.tokens[None].to(device),
            attention_mask=masks,
            position_ids=places[None].to(device),
            **kv.cache_argument(self.model, state.cache),
            use_cache=True,
        )
        return out.logits[0].float()  # stays on the model's device: greedy needs only the argmax

    @torch.inference_mode()
    def commit(self, state: TargetState, prefix_length: int, path: tuple[int, ...]) -> None:
        """Keep the prefix plus the accepted path (root included) in the cache."""
        kv.keep_path(state.cache, prefix_length, list(path))
