"""Asynchronous SSM prefetch: draft step t+1's tree for step t's likely outcomes while the target
verifies step t's tree.

An *outcome* of step t is the accepted path plus the target's next token (the bonus or recovered
token, step t+1's root), so each prepared tree is drafted for a guessed committed sequence:
``committed + path[:d] + (guess,)``, d >= 0. The SSM guesses from its own tree and one forward over
the root and its best path (``path_guesses``). A prepared tree is computed exactly as the normal
draft would be: the same cache prefix, the same tokens fed in one forward, the same generator
(made from the committed length, ``engine.step.Assignment.generator``) and the same shape
history. So when the verdict matches a guess, the prepared tree *is* the tree the normal path
would draft; otherwise it is dropped, with the KV entries it added. ``actors.ssm`` runs this beside the verifier.

``Ahead`` is one request's drafting with prefetch on one proposer, the same for both transports:
``actors.ssm`` (the SSM actor drafts ahead while the merge actor and the verifier work) and
``engine.generate`` (in-process: a thread drafts ahead while this one verifies; on CUDA the
drafter's work runs on a stream of its own, ``ModelDrafter.on_own_stream``).

A ``ModelDrafter`` over a ``DynamicCache`` keeps a prepared tree's KV entries as a copy in memory;
a ``PagedDrafter`` (continuous batching) copies them into blocks of their own in its pool (its
prefetch forwards join the packed forwards of the other requests) and gives them back when the
tree is dropped.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .draft import DraftedLevels, DraftSpec, ModelDrafter, Proposal
from .kv_pool import PoolExhausted
from .shape import ShapeHistory
from .step import Assignment, Drafted, Prefetched, draft_with
from .tree import TokenTree, children

logger = logging.getLogger(__name__)

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


def path_guesses(committed: Sequence[int], tree: TokenTree, path: Sequence[int], logits: torch.Tensor,  # [G + 1, V]
                 count: int) -> list[Committed]:
    """Up to ``count`` outcomes: the whole path accepted first, then the path cut at a depth d >= 0,
    most likely first.

    ``logits[d]``: the SSM's logits after ``path[:d]`` (``logits[0]`` at the root). If the target
    takes ``path[:d]`` and then none of that node's children, its next token is most likely the
    SSM's best token outside those children, ``g_d``. A cut's score is the SSM's probability of
    ``path[:d]`` times that of ``g_d``.
    Example: root r with child a, a with child b (the path); SSM at r: a 0.5, z 0.3; after a: b 0.6,
    x 0.3; after b: y 0.6. Outcomes: (a, b, y) (the whole path, always first), then (z) (score 0.3;
    a is r's child, so excluded), then (a, x) (0.5 * 0.3; b excluded).
    """
    tokens, kids = tree.tokens.tolist(), children(tree.parents)
    probs = torch.softmax(logits.float(), dim=-1)  # [G + 1, V]
    cuts, reach = [], 1.0
    for d, node in enumerate([0] + list(path)):
        row = probs[d].clone()
        row[[tokens[child] for child in kids[node]]] = 0.0
        guess = int(row.argmax())
        cuts.append((reach * float(row[guess]), -d, tuple(committed) + tuple(tokens[n] for n in path[:d]) + (guess,)))
        if d < len(path):
            reach *= float(probs[d, tokens[path[d]]])
    whole = cuts.pop()[2]
    return [whole] + [outcome for _, _, outcome in sorted(cuts, reverse=True)][:max(0, count - 1)]


def path_logits(drafter: ModelDrafter, cache, committed: Sequence[int], path_tokens: list[int]) -> torch.Tensor:  # -> [G + 1, V]
    """The SSM's logits at the root and after each path token: one forward over the root (fed
    again) and the path. The root's KV entry is put back as it was, so the cache is unchanged."""
    base = len(committed)
    root = drafter.save_entries(cache, base - 1)
    drafter.rollback(cache, base - 1)
    try:
        return drafter.forward_tokens(cache, [committed[-1]] + path_tokens)
    finally:
        drafter.restore_entries(cache, base - 1, root)


@dataclass(frozen=True)
class Prepared:
    """A tree drafted ahead for one outcome, with what drafting it left in the SSM's state."""

    committed: Committed
    proposal: Proposal
    draft_ms: float
    entries: object  # the KV entries past the step's committed length (ModelDrafter.save_entries)
    history: ShapeHistory | None  # the shape history drafting left (None: not cost-aware)
    levels: DraftedLevels | None = None  # the drafted levels it put aside (ModelDrafter.levels_of)


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

    def drop(self, drafter: ModelDrafter, cache, keep: Prepared | None = None) -> None:
        """Give back the saved entries of every prepared tree but ``keep`` (no prefetch may run:
        with a paged pool they hold blocks of their own)."""
        with self._lock:
            prepared, self._prepared = self._prepared, {}
        for entry in prepared.values():
            if entry is not keep:
                drafter.drop_entries(cache, entry.entries)

    @property
    def guesses(self) -> list[Committed]:
        with self._lock:
            return list(self._guesses)


def prefetch(drafter: ModelDrafter, cache, committed: list[int], tree: TokenTree,
             generator_at: Callable[[int], torch.Generator], count: int, job: PrefetchJob) -> None:
    """Draft ahead, with ``job.spec``, for up to ``count`` outcomes of the tree just drafted (``tree``,
    at ``committed``).

    The cache must hold exactly ``committed`` (as ``draft`` leaves it); it does again on return,
    and the shape history is as before: only ``job`` keeps what was drafted. With a paged pool the
    entries of each prepared tree are copied into blocks of their own, from the pool's unreserved
    blocks; when none is left, prefetching stops there (the trees prepared so far stay).
    """
    path, base = best_path(tree), len(committed)
    if not path or count < 1:
        return
    saved, levels = copy.deepcopy(drafter.shape_of(cache)), drafter.levels_of(cache)
    try:
        logits = path_logits(drafter, cache, committed, tree.tokens[path].tolist())
        job.offer(path_guesses(committed, tree, path, logits, count))
        while (outcome := job.next_guess()) is not None:
            began = time.perf_counter()
            proposal = drafter.draft(cache, list(outcome), job.spec, generator_at(len(outcome)))
            draft_ms = (time.perf_counter() - began) * 1e3
            job.add(Prepared(outcome, proposal, draft_ms, drafter.save_entries(cache, base),
                             copy.deepcopy(drafter.shape_of(cache)), drafter.levels_of(cache)))
            drafter.rollback(cache, base)
            drafter.set_shape(cache, copy.deepcopy(saved))
            drafter.set_levels(cache, levels)  # each guess starts from the step's own drafted levels
    except PoolExhausted:
        logger.debug("prefetch stopped: the SSM's pool has no unreserved block left")
    finally:
        drafter.rollback(cache, base)
        drafter.set_shape(cache, saved)
        drafter.set_levels(cache, levels)


def record_outcome(drafter: ModelDrafter, cache, hit: bool) -> None:
    """Fold whether this step's tree was ready into the request's shape history (its *overlap*: the
    cost model then counts that share of drafting as hidden behind verification). Call it after the
    step's tree is drafted or installed: a tree prepared ahead saw the history before this step's
    outcome, and so does the normal path's."""
    history = drafter.shape_of(cache)
    if history is not None:
        history.record_prefetch(hit)


def install(drafter: ModelDrafter, cache, job: PrefetchJob, prepared: Prepared) -> None:
    """Make the state what drafting ``prepared`` left: its KV entries, shape history and drafted levels."""
    drafter.restore_entries(cache, job.base, prepared.entries)
    drafter.set_shape(cache, prepared.history)
    drafter.set_levels(cache, prepared.levels)


def take_or_draft(drafter: ModelDrafter, cache, committed: list[int], assignment: Assignment,
                  job: PrefetchJob | None) -> Drafted:
    """The step's tree at ``committed``: the one drafted ahead for exactly these tokens and this spec,
    installed (a hit), or drafted now (a miss, or no prefetch ran; the cache is back at the committed
    tokens either way). The caller holds the request's lock, so no prefetch runs."""
    if job is None:
        return draft_with(drafter, cache, committed, assignment.spec, assignment.generator(len(committed)))
    prepared = job.take(committed) if job.spec == assignment.spec else None
    job.drop(drafter, cache, keep=prepared)
    if prepared is not None:
        install(drafter, cache, job, prepared)
        drafted = Drafted(prepared.proposal, prefetched=Prefetched(hits=1, saved_ms=prepared.draft_ms))
    else:
        drafted = draft_with(drafter, cache, committed, assignment.spec, assignment.generator(len(committed)))
        drafted = replace(drafted, prefetched=Prefetched(misses=1))
    record_outcome(drafter, cache, prepared is not None)
    return drafted


class Ahead:
    """One request's drafting on one proposer with prefetch: the lock a prefetch holds while it
    drafts, and its job. The SSM actor passes its request guard's lock, so dropping the state
    waits for a prefetch too."""

    def __init__(self, lock: threading.Lock | None = None):
        self.lock = lock if lock is not None else threading.Lock()
        self.job: PrefetchJob | None = None

    def announce(self, committed: Sequence[int]) -> None:
        """Name the outcome to a running prefetch: it stops after the tree it needs (or at once)."""
        job = self.job
        if job is not None:
            job.want(committed)

    def draft(self, drafter: ModelDrafter, cache, committed: list[int], assignment: Assignment, count: int,
              pool: Executor, ready: Callable[[], bool] = lambda: True) -> Drafted | None:
        """The step's tree: ``announce`` the committed tokens, take the lock (so wait for the prefetch),
        take the prepared tree or draft one, then, with ``count`` > 0, hand the lock to a new prefetch
        on ``pool`` (the next call waits for it). ``ready()``, called with the lock held, may refuse
        (None: the state was dropped) or bring the state up to ``committed``. ``draft_ms`` counts the
        wait."""
        began = time.perf_counter()
        self.announce(committed)
        self.lock.acquire()
        handed = False
        try:
            if not ready():
                return None
            job, self.job = self.job, None
            with drafter.on_own_stream():
                drafted = take_or_draft(drafter, cache, committed, assignment, job)
            if count > 0 and drafted.proposal.tree.size > 1:
                self.job = PrefetchJob(len(committed), assignment.spec)
                pool.submit(self._run, drafter, cache, list(committed), drafted.proposal.tree, assignment, count,
                            self.job)
                handed = True
            return replace(drafted, draft_ms=(time.perf_counter() - began) * 1e3)
        finally:
            if not handed:
                self.lock.release()

    def close(self, drafter: ModelDrafter, cache) -> None:
        """Drop the job and what it prepared. The caller holds the lock (no prefetch runs)."""
        job, self.job = self.job, None
        if job is not None:
            job.drop(drafter, cache)

    def release(self, drafter: ModelDrafter, cache) -> None:
        """``close`` once a running prefetch has stopped (told at once: nobody wants its trees)."""
        self.announce(())
        with self.lock:
            self.close(drafter, cache)

    def _run(self, drafter: ModelDrafter, cache, committed: list[int], tree: TokenTree, assignment: Assignment,
             count: int, job: PrefetchJob) -> None:
        """On the pool, holding the lock ``draft`` handed over; releases it."""
        try:
            with drafter.on_own_stream():
                prefetch(drafter, cache, committed, tree, assignment.generator, count, job)
        except Exception:  # the next draft call drafts as usual (the cache is back at the committed tokens)
            logger.exception("prefetch failed; drafting goes on without it")
        finally:
            self.lock.release()
