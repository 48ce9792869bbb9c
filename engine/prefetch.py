"""Asynchronous SSM prefetch: draft step t+1's tree for step t's likely outcomes while the target
verifies step t's tree.

An *outcome* of step t is the accepted path plus the target's next token (the bonus or recovered
token, step t+1's root), so each prepared tree is drafted for a guessed committed sequence:
``committed + path[:d] + (guess,)``. The SSM guesses from its own tree and one forward along its
best path (``path_guesses``). A prepared tree is computed exactly as the normal draft would be:
the same cache prefix, the same tokens fed in one forward, the same generator (made from the
committed length, ``engine.step.Assignment.generator``) and the same shape history. So when the
verdict matches a guess, the prepared tree *is* the tree the normal path would draft; otherwise it
is dropped, with the KV entries it added. ``actors.ssm`` runs this beside the verifier.

Only ``ModelDrafter`` over a ``DynamicCache`` prefetches (not the paged, continuously batched drafter).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import kv
from .draft import DraftSpec, ModelDrafter, Proposal
from .shape import ShapeHistory
from .tree import TokenTree, children

Committed = tuple[int, ...]


def best_path(tree: TokenTree) -> list[int]:
    """The proposer's own best path: from the root, each node's first child, down to a leaf.

    Top-k children are drawn most likely first, so the first child is the SSM's argmax; for drawn
    children it is the first draw. Example: parents [-1, 0, 0, 1, 3, 1] -> [1, 3, 4].
    """
    kids, path, node = children(tree.parents), [], 0
    while kids[node]:
        node = kids[node][0]
        path.append(node)
    return path


def path_guesses(committed: Sequence[int], tree: TokenTree, path: Sequence[int], logits: torch.Tensor,  # [G, V]
                 count: int) -> list[Committed]:
    """Up to ``count`` outcomes: the whole path accepted first, then the path cut at a depth d >= 1,
    most likely first.

    ``logits[d - 1]``: the SSM's logits after ``path[:d]``. If the target takes ``path[:d]`` and
    then none of node ``path[d-1]``'s children, its next token is most likely the SSM's best token
    outside those children, ``g_d``. A cut's score is the SSM's probability of the path below its
    first node times that of ``g_d`` (the first node's probability is common to all).
    Example: path tokens (a, b), SSM after a: b 0.6, x 0.3; after b: y 0.6. Outcomes: (a, b, y)
    (the whole path, always first), then (a, x) (b is a child of a, so excluded).
    """
    tokens, kids = tree.tokens.tolist(), children(tree.parents)
    probs = torch.softmax(logits.float(), dim=-1)  # [G, V]
    cuts, reach = [], 1.0
    for d, node in enumerate(path, start=1):
        row = probs[d - 1].clone()
        row[[tokens[child] for child in kids[node]]] = 0.0
        guess = int(row.argmax())
        cuts.append((reach * float(row[guess]), -d, tuple(committed) + tuple(tokens[n] for n in path[:d]) + (guess,)))
        if d < len(path):
            reach *= float(probs[d - 1, tokens[path[d]]])
    whole = cuts.pop()[2]
    return [whole] + [outcome for _, _, outcome in sorted(cuts, reverse=True)][:max(0, count - 1)]


@dataclass(frozen=True)
class Prepared:
    """A tree drafted ahead for one outcome, with what drafting it left in the SSM's state."""

    committed: Committed
    proposal: Proposal
    draft_ms: float
    entries: tuple  # the KV entries past the step's committed length (kv.tail)
    history: ShapeHistory | None  # the shape history drafting left (None: not cost-aware)


class PrefetchJob:
    """One request's prefetch for one step, shared by the thread that drafts ahead and the next
    draft call: the call names the outcome it needs (``want``), the prefetch stops after it (or at
    once when it is not among the guesses), and the call takes the prepared tree if there is one."""

    def __init__(self, base: int, spec: DraftSpec):
        self.base = base  # the committed length the tree being verified was drafted at
        self.spec = spec  # what it drafts with: a prepared tree serves only a draft call with this spec
        self._lock = threading.Lock()
        self._guesses: list[Committed] = []
        self._prepared: dict[Committed, Prepared] = {}
        self._wanted: Committed | None = None

    def want(self, committed: Sequence[int]) -> None:
        with self._lock:
            self._wanted = tuple(committed)

    def offer(self, guesses: Sequence[Committed]) -> None:
        with self._lock:
            self._guesses = list(guesses)

    def next_guess(self) -> Committed | None:
        """The next outcome to draft for, None to stop (all done, or the one wanted is known)."""
        with self._lock:
            remaining = [g for g in self._guesses if g not in self._prepared]
            if self._wanted is not None:
                return self._wanted if self._wanted in remaining else None
            return remaining[0] if remaining else None

    def add(self, prepared: Prepared) -> None:
        with self._lock:
            self._prepared[prepared.committed] = prepared

    def take(self, committed: Sequence[int]) -> Prepared | None:
        with self._lock:
            return self._prepared.get(tuple(committed))

    @property
    def guesses(self) -> list[Committed]:
        with self._lock:
            return list(self._guesses)


def prefetch(drafter: ModelDrafter, cache, committed: list[int], tree: TokenTree,
             generator_at: Callable[[int], torch.Generator], count: int, job: PrefetchJob) -> None:
    """Draft ahead, with ``job.spec``, for up to ``count`` outcomes of the tree just drafted (``tree``,
    at ``committed``).

    The cache must hold exactly ``committed`` (as ``draft`` leaves it); it does again on return,
    and the shape history is as before: only ``job`` keeps what was drafted.
    """
    path, base = best_path(tree), len(committed)
    if not path or count < 1:
        return
    saved = copy.deepcopy(drafter.shape_of(cache))
    try:
        path_tokens = tree.tokens[path].tolist()
        job.offer(path_guesses(committed, tree, path, drafter.forward_tokens(cache, path_tokens), count))
        while (outcome := job.next_guess()) is not None:
            began = time.perf_counter()
            proposal = drafter.draft(cache, list(outcome), job.spec, generator_at(len(outcome)))
            draft_ms = (time.perf_counter() - began) * 1e3
            job.add(Prepared(outcome, proposal, draft_ms, kv.tail(cache, base),
                             copy.deepcopy(drafter.shape_of(cache))))
            kv.crop(cache, base)
            drafter.set_shape(cache, copy.deepcopy(saved))
    finally:
        kv.crop(cache, base)
        drafter.set_shape(cache, saved)


def install(drafter: ModelDrafter, cache, job: PrefetchJob, prepared: Prepared) -> None:
    """Make the state what drafting ``prepared`` left: its KV entries and its shape history."""
    kv.restore_tail(cache, job.base, prepared.entries)
    drafter.set_shape(cache, prepared.history)
