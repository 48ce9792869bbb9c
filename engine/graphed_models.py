"""The target and an SSM drafter whose forwards replay CUDA graphs (``engine.graphs``).

``GraphedTarget`` has ``TargetModel``'s methods and ``GraphedDrafter`` is a ``ModelDrafter``: the
speculative step is the same code; only their forwards and KV bookkeeping go through a
``GraphRunner``, whose one buffer holds one request at a time (the in-process engine's way).
"""

from __future__ import annotations

import torch

from .draft import ModelDrafter, TreeBuilder, level_visibility
from .graphs import GraphRunner, StaticSequence
from .target import ForwardsAlone
from .tree import TokenTree, ancestor_mask, positions


def chain(n: int) -> torch.Tensor:  # -> [n, n] bool
    """Tokens fed in order see each other causally. Example: n 2 -> [[1, 0], [1, 1]]."""
    return torch.ones(n, n, dtype=torch.bool).tril()


class GraphedTarget(ForwardsAlone):
    """The target (``engine.target.Target``) over a GraphRunner's buffer."""

    def __init__(self, runner: GraphRunner):
        self.runner, self.model = runner, runner.model

    def new_state(self, reserve_tokens: int = 0) -> StaticSequence:
        return self.runner.claim()

    def release(self, state: StaticSequence) -> None:
        self.runner.release(state)

    def shutdown(self) -> None:
        """Nothing beyond the model, which the caller owns."""

    def prefill(self, state: StaticSequence, prompt_ids: list[int]) -> torch.Tensor:  # -> [V]
        n = len(prompt_ids)
        logits = self.runner.forward(torch.tensor(prompt_ids), torch.arange(n), 0, chain(n), last_only=True)
        state.length = n
        return logits[0].cpu()

    def forward_tree(self, state: StaticSequence, tree: TokenTree) -> torch.Tensor:  # -> [N, V]
        """One forward over the tree after the prefix; its entries stay until ``commit``."""
        return self.runner.forward(tree.tokens, positions(tree.parents, state.length), state.length,
                                   ancestor_mask(tree.parents))

    def commit(self, state: StaticSequence, prefix_length: int, path: tuple[int, ...]) -> None:
        self.runner.keep(prefix_length, list(path))
        state.length = prefix_length + len(path)


class GraphedDrafter(ModelDrafter):
    """A neural SSM drafting a tree level per graph replay. Its state's ``length`` counts every entry
    in the buffer (committed ones, then drafted levels), as a DynamicCache's length does."""

    def __init__(self, runner: GraphRunner, proposer: int, name: str):
        super().__init__(runner.model, proposer, name)
        self.runner = runner

    def new_state(self) -> StaticSequence:
        return self.runner.claim()

    def release(self, state: StaticSequence) -> None:
        super().release(state)
        self.runner.release(state)

    def forward_tokens(self, state: StaticSequence, tokens: list[int]) -> torch.Tensor:  # -> [G, V]
        """The SSM's logits after each of ``tokens`` fed after the held entries, which stay as they were."""
        n, start = len(tokens), state.length
        return self.runner.forward(torch.tensor(tokens), torch.arange(start, start + n), start, chain(n)).cpu()

    def save_entries(self, state: StaticSequence, start: int) -> object:
        return self.runner.save(start, state.length)

    def restore_entries(self, state: StaticSequence, start: int, saved: object) -> None:
        state.length = start + self.runner.put(start, saved)

    def rollback(self, state: StaticSequence, length: int) -> None:
        state.length = min(state.length, length)

    def _resume(self, state: StaticSequence, committed: list[int]) -> int:
        """``ModelDrafter._resume`` over the buffer: the accepted tokens the last draft expanded are
        written back from its saved levels."""
        length, levels = state.length, self._levels.pop(state, None)
        if levels is not None and length == len(levels.prefix):
            rows = levels.rows_for(committed)
            if rows:
                length += self.runner.put(length, levels.entries, rows)
        state.length = min(length, len(committed) - 1)
        return state.length

    def _extend(self, state: StaticSequence, committed: list[int]) -> tuple[torch.Tensor, int]:  # -> [V], fed
        start = self._resume(state, committed)
        n = len(committed) - start
        logits = self.runner.forward(torch.tensor(committed[start:]), torch.arange(start, start + n), start, chain(n),
                                     last_only=True)
        state.length = start + n
        self.runner.wait()  # so the clocks around a draft's forwards (cost-aware shapes) count the device's work
        return logits[0], n  # on the device: top-k children are chosen there (choose_children)

    def _forward_level(self, state: StaticSequence, builder: TreeBuilder, level: list[int], cached: list[int],
                       depth: int, committed_length: int) -> torch.Tensor:  # -> [F, V]
        """One forward over the level's nodes to expand; keys are [committed | cached | level]. The
        logits stay on the model's device (``choose_children`` takes them to the CPU where it samples)."""
        visible = level_visibility(builder, level, cached)  # [F, K]
        tokens = torch.tensor([builder.tokens[n] for n in level])
        logits = self.runner.forward(tokens, torch.full_like(tokens, committed_length - 1 + depth), committed_length,
                                     visible)
        state.length = committed_length + visible.shape[1]
        self.runner.wait()
        return logits  # on the device
