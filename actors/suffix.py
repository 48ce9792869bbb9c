"""The suffix-tree proposer (SuffixDecoding, Oliaro et al. 2024) over arctic-inference's suffix trees.

Model-free: it proposes what followed the longest suffix of the committed tokens that occurred
before, in the request's own prompt and output (a local tree per request) or in the responses of
earlier requests (a global tree). Its proposal is already a tree (several continuations, scored
by how often each followed), with deterministic children. It lives here, not in ``engine``,
because ``engine`` imports only torch, transformers and the standard library.

Two caches, so that a request that is not ``adaptive`` neither reads nor writes the global store
(a seeded request then gives the same tokens whatever else the server ran):

* ``shared``: local trees plus the global tree of up to ``max_cached_requests`` responses,
  evicted first in, first out as whole responses (0: no global tree);
* ``private``: local trees only.

A request is started in the cache its first spec chooses and stays there.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
from arctic_inference.suffix_decoding import SuffixDecodingCache

from engine.draft import DraftSpec, Proposal, TreeBuilder
from settings.config import SuffixConfig


@dataclass
class SuffixState:
    """One request in a ``SuffixDrafter``: its key in the cache it was started in, and how many
    committed tokens that cache holds (prompt and response)."""

    key: int
    cache: SuffixDecodingCache | None = None  # None until the first draft, and after release
    fed: int = 0
    released: bool = False


def tree_proposal(root: int, proposer: int, tokens: Sequence[int], parents: Sequence[int],
                  max_nodes: int) -> Proposal:
    """A suffix draft as a proposal of at most ``max_nodes`` nodes, root included.

    tokens:  # [N] drafted tokens, each after its parent
    parents: # [N] index into ``tokens``; -1: a child of the root (the last committed token)
    Example: root 5, tokens [9, 7, 3], parents [-1, -1, 0], max_nodes 3 -> tree tokens [5, 9, 7],
    parents [-1, 0, 0] (token 3 would be a fourth node).
    """
    builder = TreeBuilder(root=root, proposer=proposer)
    nodes: list[int] = []  # the tree node of each drafted token
    for token, parent in zip(tokens, parents):
        if len(builder.tokens) >= max_nodes:
            break
        if not -1 <= parent < len(nodes):
            raise ValueError(f"suffix draft token {len(nodes)} has parent {parent}: parents must come first")
        nodes.append(builder.add(0 if parent < 0 else nodes[parent], int(token), None))
    return builder.build()


class SuffixDrafter:
    """The drafter interface of ``engine.draft.ModelDrafter`` over two ``SuffixDecodingCache``s.

    Thread-safe (one lock around the caches): the merge actor runs requests on several threads.
    Example: prompt [3, 5, 9, 3], first output 5 -> committed [3, 5, 9, 3, 5]; the first draft
    starts the request with [3, 5, 9, 3] and feeds [5]; context [..., 3, 5] matched [3, 5] -> 9.
    """

    neural = False  # model-free (``engine.step.plan_proposers``)

    def __init__(self, proposer: int, config: SuffixConfig = SuffixConfig()):
        self.proposer, self.name, self.config = proposer, config.name, config
        self.shared = SuffixDecodingCache(config.max_tree_depth, config.max_cached_requests)
        self.private = SuffixDecodingCache(config.max_tree_depth, 0)
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def new_state(self) -> SuffixState:
        return SuffixState(next(self._keys))

    def release(self, state: SuffixState) -> None:
        """Stop the request (its local tree goes; its response stays in the global store until
        evicted). Idempotent; a later draft of it proposes nothing."""
        with self._lock:
            if state.cache is not None:
                state.cache.stop_request(state.key)
            state.cache, state.released = None, True

    def forget_responses(self) -> None:
        """Empty the global store (benchmarks: a prompt's earlier runs must not hand the next method
        its answer). Requests in flight keep their local trees."""
        with self._lock:
            for key in list(self.shared.cached_requests):
                self.shared.evict_cached_response(key)

    def draft(self, state: SuffixState, committed: list[int], spec: DraftSpec,
              generator: torch.Generator | None = None) -> Proposal:
        """Feed the committed tokens the cache lacks, then speculate from their last
        ``max_tree_depth``. ``committed`` ends with the root; ``generator`` is unused."""
        c = self.config
        budget = min(c.max_spec_tokens, (spec.max_nodes or c.max_spec_tokens + 1) - 1)  # nodes below the root
        with self._lock:
            cache = self._feed(state, committed, spec.adaptive)
            if cache is None or budget < 1:  # 0 would mean "up to max_tree_depth" to the cache
                return tree_proposal(committed[-1], self.proposer, (), (), 1)
            draft = cache.speculate(state.key, committed[-c.max_tree_depth:], max_spec_tokens=budget,
                                    max_spec_factor=c.max_spec_factor, max_spec_offset=c.max_spec_offset,
                                    min_token_prob=c.min_token_prob, use_tree_spec=True)
        return tree_proposal(committed[-1], self.proposer, draft.token_ids, draft.parents, budget + 1)

    def _feed(self, state: SuffixState, committed: list[int], adaptive: bool) -> SuffixDecodingCache | None:
        """Start the request on its first draft (prompt: all but the root), then append the
        committed tokens not fed yet. None once released. Call with the lock held."""
        if state.released:
            return None
        if state.cache is None:
            state.cache = self.shared if adaptive else self.private
            state.cache.start_request(state.key, committed[:-1])
            state.fed = len(committed) - 1
        if len(committed) > state.fed:
            state.cache.add_active_response(state.key, committed[state.fed:])
            state.fed = len(committed)
        return state.cache
