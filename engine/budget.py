"""Tree size by load, from a measured verify-cost curve (ms of one pass vs tokens in it)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from .shape import BatchLoad
from .tree import TokenTree


@dataclass(frozen=True)
class TreeBudget:
    """``cap``: tree tokens per verify pass over the whole batch; each request gets an equal share."""

    cap: int
    min_tree_nodes: int = 2
    disable_above: int | None = None  # more running requests than this: no speculation (vLLM's disable_by_batch_size)

    def per_request(self, running: int) -> int:
        """Nodes (root included) one request's tree may have when ``running`` requests share a pass.

        Example: cap 32, min 2 -> 1 running: 32, 4 running: 8, 32 running: 2; with disable_above 16,
        32 running: 1 (the root alone: plain decoding, no drafting).
        """
        if self.disable_above is not None and running > self.disable_above:
            return 1
        return max(self.min_tree_nodes, self.cap // max(1, running))


class RunningLoad:
    """What each running request puts into the shared verify pass: its last step's tokens (tree
    nodes, root included) and its expected tokens per step (committed tokens, faded by ``fade``);
    ``others(key)`` is the ``BatchLoad`` a request's cost-aware shape plans against.

    A request that has not stepped yet counts as a decode step (1 token, 1 expected).
    Example: a steps with 5 tokens committing 3, b joins: others(a) = (1, 1.0), others(b) =
    (5, 2.0) with fade 0.5 (1 -> 0.5 * 1 + 0.5 * 3).
    """

    def __init__(self, fade: float = 0.5):
        self.fade = fade
        self._lock = threading.Lock()
        self._running: dict[Hashable, tuple[int, float]] = {}

    def join(self, key: Hashable) -> None:
        with self._lock:
            self._running[key] = (1, 1.0)

    def leave(self, key: Hashable) -> None:
        with self._lock:
            self._running.pop(key, None)

    def record(self, key: Hashable, tokens: int, committed: int) -> None:
        """One step of ``key``: ``tokens`` in its verify pass, ``committed`` tokens taken."""
        with self._lock:
            if key in self._running:
                expected = self._running[key][1]
                self._running[key] = (tokens, self.fade * expected + (1.0 - self.fade) * committed)

    def others(self, key: Hashable) -> BatchLoad:
        with self._lock:
            rest = [load for other, load in self._running.items() if other != key]
        return BatchLoad(sum(tokens for tokens, _ in rest), sum(expected for _, expected in rest))


def budget_from_curve(curve: dict[int, float], slack: float, min_tree_nodes: int = 2,
                      disable_above: int | None = None) -> TreeBudget:
    """The largest measured pass size costing at most (1 + slack) x a one-token pass.

    While a pass costs about as much as a decode step the target is memory-bound and extra tree
    tokens are nearly free; past that they cost compute that the batch's other requests need.
    Example: {1: 185, 4: 190, 8: 222, 16: 280, 32: 410}, slack 0.6 (limit 296) -> cap 16.
    """
    if 1 not in curve:
        raise ValueError("the verify-cost curve needs the one-token pass (size 1)")
    limit = (1.0 + slack) * curve[1]
    cap = max(size for size, ms in curve.items() if ms <= limit)
    return TreeBudget(cap, min_tree_nodes, disable_above)


EMULATED_TOKENS = 8  # the pass compared with the one-token pass
EMULATED_RATIO = 3.0  # ... costing more than this many one-token passes: cost grows about with the tokens


def grows_with_tokens(curve: dict[int, float]) -> bool:
    """Whether a verify pass costs about in proportion to its tokens, as emulated bf16 products do:
    the 8-token pass above 3x the one-token pass (where the curve stopped below 8 tokens, its
    largest size of at least 4 against the same slope, e.g. 4 tokens above 1.5x). A curve without
    the one-token pass or a pass of 4 or more tokens tells nothing (False).

    Measured on the default target: emulated bf16 (2-core AVX2 EPYC) 255 -> 1,429 ms (5.6x, True);
    float32 on oneDNN there ~300 -> ~700 ms (2.3x, False); native bf16 (AMX) 152 -> 159 ms (False).
    """
    sizes = [size for size in curve if 4 <= size <= EMULATED_TOKENS]
    if 1 not in curve or not sizes or curve[1] <= 0:
        return False
    size = max(sizes)
    return curve[size] > EMULATED_RATIO * size / EMULATED_TOKENS * curve[1]


RESWEEP_MAX_TOKENS = 16  # the passes a tree's verify usually costs: timed again by extra sweeps
CURVE_SWEEPS = 3  # sweeps of every verify-cost curve the engine and the verifier measure


def measure_curve(time_pass: Callable[[int], float], max_tokens: int, slack: float, sweeps: int = 1) -> dict[int, float]:
    """ms per pass at 1, 2, 4, ... tokens, stopping after the first size past the slack limit.

    A first, discarded pass warms the kernels up (the first pass of a shape is slower). With one
    sweep, the one-token pass is timed again at the end, keeping the faster, so that one slow
    reference (other work on the machine) cannot inflate the whole budget. With ``sweeps`` > 1 the
    sizes up to ``RESWEEP_MAX_TOKENS`` are timed in that many interleaved sweeps (the one-token pass
    once more at the end) and keep their median: a slow stretch of the machine moves one sample of
    each size, not the curve's shape, which cost-aware trees read.

    Example (sweeps 3): size 4 timed 560, then 700 during a slow stretch, then 540 -> 560.
    """
    time_pass(1)
    curve, size = {}, 1
    while size <= max_tokens:
        curve[size] = time_pass(size)
        if curve[size] > (1.0 + slack) * curve[1]:
            break
        size *= 2
    if sweeps <= 1:
        curve[1] = min(curve[1], time_pass(1))
        return curve
    samples = {size: [ms] for size, ms in curve.items() if size <= RESWEEP_MAX_TOKENS}
    for _ in range(sweeps - 1):
        for size, times in samples.items():
            times.append(time_pass(size))
    samples[1].append(time_pass(1))
    curve.update({size: statistics.median(times) for size, times in samples.items()})
    return curve


def time_tree_pass(target, state, size: int) -> float:
    """ms of one verify pass over a chain of ``size`` tokens on ``state`` (``engine.target.Target``),
    committed as the root alone afterwards (the state's cache grows by one token per pass)."""
    tree = TokenTree(torch.zeros(size, dtype=torch.long), torch.arange(-1, size - 1, dtype=torch.long))
    prefix = state.length
    began = time.perf_counter()
    logits = target.forward_tree(state, tree)  # [N, V]
    if logits.is_cuda:  # the pass's device work, not only its launch
        torch.cuda.synchronize(logits.device)
    elapsed = (time.perf_counter() - began) * 1e3
    target.commit(state, prefix, (0,))
    return elapsed


def measure_target_curve(target, max_tokens: int, slack: float, prefix: int = 256,
                         sweeps: int = CURVE_SWEEPS) -> dict[int, float]:
    """The verify-cost curve of any target (``engine.target.Target``) on a ``prefix``-token request:
    what cost-aware shapes read where no packed-forward timing exists (in-process engines). Each
    size is the median over ``sweeps`` interleaved sweeps (``measure_curve``; the batched verifier
    times its packed passes the same way): on a 2-core AVX2 box with CPU steal one sweep's 8-token
    pass ranged 1.28-1.61x the one-token pass over five sweeps."""
    state = target.new_state(reserve_tokens=prefix + 4 * max_tokens + 64)
    try:
        target.prefill(state, [0] * prefix)
        return measure_curve(lambda size: time_tree_pass(target, state, size), max_tokens, slack, sweeps)
    finally:
        target.release(state)
