"""Cost-aware tree shapes (after EAGLE-2): grow the tree by path probability, keep the size that pays.

An SSM drafts level by level, expanding the ``beam`` most probable nodes of each level (over the
whole level, not per parent) with their ``branch`` most likely children. Each node's *path
probability* is the product of the SSM's probabilities along its path. After drafting, the nodes
are ranked by path probability and the tree keeps the ``n`` best, where ``n`` maximises expected
tokens per millisecond of the step:

    rate(n) = (1 + sum of acceptance(p_i), i < n) / step_ms(draft_ms, verify_ms(n + 1))

where ``step_ms`` is their sum, less what prefetch hides: with ``speculation.prefetch`` a share of
the request's drafts (its *overlap*, the faded rate of prefetch hits) was drafted during the previous
verification, and there the shorter of the two is hidden (``step_ms``).
``acceptance(p)`` is calibrated from the request's own history (how often a node of path
probability about ``p`` was accepted; the prior is ``p`` itself), ``verify_ms`` is the target's
measured verify-cost curve. Each level expands only as many of the ``beam`` best nodes as are
expected to pay (``frontier_to_expand``): on a confident stretch the tree grows as a chain, a
one-token SSM forward per level, and drafting stops when one more level is not expected to raise
the best rate. Under continuous batching the verify pass is shared (``BatchLoad``): the choice maximises the
*batch's* expected tokens per ms (after SmartSpec's goodput), counting the other running requests'
tokens in the pass and their expected accepted tokens, so that a request keeps fewer nodes, or none
(plain decoding), when its extra tokens would slow everyone more than they add. Ranking by path probability keeps every kept node's parent (a child's path probability never
exceeds its parent's), so the kept nodes form a tree. Only deterministic (top-k) children are
ranked this way: the verifier treats them as point masses, so the shape may follow the SSM's
outputs without biasing sampled output.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

# Path-probability bins of the calibration (upper edges).
BIN_EDGES = (0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0)
PRIOR = 2.0  # prior weight, in units of summed path probability, of "acceptance = path probability"
# Each step the history fades by this factor, so the prior returns: a request whose trees stopped
# paying (no nodes proposed, nothing learnt) tries again after a few steps instead of never.
DECAY = 0.9


@dataclass(frozen=True)
class BatchLoad:
    """The other running requests sharing a request's verify pass (continuous batching): the
    tokens they put in it and the tokens they are expected to commit per step."""

    tokens: int = 0
    expected: float = 0.0


@dataclass(frozen=True)
class TreeCost:
    """What a cost-aware shape needs: the target's verify cost and the growth limits.

    verify_ms: (tokens in one verify pass, ms) measured on the target, sizes ascending, 1 first.
    """

    verify_ms: tuple[tuple[int, float], ...]
    beam: int = 4
    branch: int = 4
    max_depth: int = 8
    # Not part of the spec's identity: a tree drafted ahead (engine.prefetch) under one step's load
    # serves the next step's draft call, whose load is a step newer.
    load: BatchLoad = field(default=BatchLoad(), compare=False)

    def __post_init__(self) -> None:
        if not self.verify_ms or self.verify_ms[0][0] != 1:
            raise ValueError("the verify-cost curve needs the one-token pass first")
        if min(self.beam, self.branch, self.max_depth) < 1:
            raise ValueError("beam, branch and max_depth must be >= 1")

    def verify(self, size: int) -> float:
        """ms of a pass over ``size`` tokens: linear between measured sizes, beyond the last by the
        last segment's slope. Example: ((1, 100), (4, 130)) -> verify(2) 110, verify(7) 160."""
        sizes = [s for s, _ in self.verify_ms]
        if len(sizes) == 1:
            return self.verify_ms[0][1]
        i = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
        (s0, m0), (s1, m1) = self.verify_ms[i - 1], self.verify_ms[i]
        return m0 + (m1 - m0) * (size - s0) / (s1 - s0)


@dataclass
class Calibration:
    """Per request: how often nodes of a given path probability were accepted, as a ratio to their
    summed path probability (per bin, shrunk towards the ratio over all bins, which is shrunk
    towards 1): ``acceptance(p) = min(1, p * ratio)``. A bin without history takes the overall
    ratio, so an SSM that is under- or over-confident everywhere is corrected in every bin."""

    mass: list[float] = field(default_factory=lambda: [0.0] * len(BIN_EDGES))  # summed path probability
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(BIN_EDGES))

    @staticmethod
    def bin(p: float) -> int:
        return min(bisect.bisect_left(BIN_EDGES, p), len(BIN_EDGES) - 1)

    def acceptance(self, p: float) -> float:
        """Estimated chance a node of path probability ``p`` is accepted. With no history: ``p``.

        Example: 10 nodes of p 0.5 seen, 2 accepted: overall ratio (2 + 2) / (5 + 2) = 0.571, the
        bin's (2 + 2 * 0.571) / (5 + 2) = 0.449: acceptance(0.5) = 0.224, acceptance(0.05) = 0.029.
        """
        return min(1.0, p * self.ratios()[self.bin(p)])

    def ratios(self) -> list[float]:
        """Each bin's accepted-to-path-probability ratio (``acceptance(p) = min(1, p * ratio)``)."""
        overall = (sum(self.accepted) + PRIOR) / (sum(self.mass) + PRIOR)
        return [(a + PRIOR * overall) / (m + PRIOR) for a, m in zip(self.accepted, self.mass)]

    def record(self, p: float, was_accepted: bool) -> None:
        b = self.bin(p)
        self.mass[b] += p
        self.accepted[b] += float(was_accepted)

    def fade(self, factor: float = DECAY) -> None:
        """Weigh the history so far by ``factor`` (one step older)."""
        self.mass = [m * factor for m in self.mass]
        self.accepted = [a * factor for a in self.accepted]


def step_ms(draft_ms: float, verify_ms: float, overlap: float = 0.0) -> float:
    """Expected ms of a step: drafting then verifying, except that in a share ``overlap`` of the
    steps the tree was drafted during the previous verification (a prefetch hit), which hides the
    shorter of the two. Example: draft 20, verify 100, overlap 0.75 -> 120 - 15 = 105."""
    return draft_ms + verify_ms - overlap * min(draft_ms, verify_ms)


def best_size(probs: Sequence[float], calibration: Calibration, draft_ms: float, cost: TreeCost,
              limit: int, overlap: float = 0.0) -> tuple[int, float]:
    """(n, rate): how many of the nodes (path probabilities, best first) to keep, at most ``limit``,
    and the expected tokens per ms with them (the root's one token counts even with n = 0). Under a
    ``cost.load`` the rate is the batch's: the others' expected tokens are added, and the pass holds
    their tokens too.

    Example: probs [0.9, 0.5, 0.1], no history, draft 20 ms, verify 100 ms + 10 ms per extra token
    -> rates 1/120, 1.9/130, 2.4/140, 2.5/150: n = 2. With a load of 7 others (14 tokens, 14 expected)
    -> 15/260, 15.9/270, 16.4/280, 16.5/290: n = 1.
    """
    load, ratios = cost.load, calibration.ratios()
    expected = load.expected + 1.0
    best = (0, expected / step_ms(draft_ms, cost.verify(load.tokens + 1), overlap))
    for n, p in enumerate(probs[:limit], start=1):
        expected += min(1.0, p * ratios[Calibration.bin(p)])
        rate = expected / step_ms(draft_ms, cost.verify(load.tokens + n + 1), overlap)
        if rate > best[1]:
            best = (n, rate)
    return best


def frontier_to_expand(probs: Sequence[float], frontier: Sequence[float], ratio: float, calibration: Calibration,
                       draft_ms: float, level_ms: Sequence[float], cost: TreeCost, limit: int,
                       overlap: float = 0.0) -> int:
    """How many of the best ``frontier`` nodes one more level should expand; 0: stop drafting.

    ``frontier``: path probabilities of the candidates (best first); each is expected to gain a best
    child of path probability ``p * ratio`` (``ratio``: the mean top child probability of the last
    level). ``level_ms[f - 1]``: the SSM forward's ms over ``f`` nodes. The count chosen is the one
    whose grown tree has the best rate (``best_size``), if that beats stopping now; so a confident
    chain is extended alone (a one-token forward, cheaper than the whole beam's), and a level is
    drafted only while it is expected to pay. ``overlap``: as in ``step_ms``.

    Example: probs [0.8, 0.1], frontier [0.8, 0.1], ratio 0.9, no history, draft 5 ms, level 10 ms
    for 1 node and 30 ms for 2, a flat 100 ms verify: rates now 1.9/105; with the 0.72 child
    2.62/115; with both children 2.71/135: expand 1.
    """
    best, now = 0, best_size(probs, calibration, draft_ms, cost, limit, overlap)[1]
    for count in range(1, len(frontier) + 1):
        grown = sorted(list(probs) + [p * ratio for p in frontier[:count]], reverse=True)
        rate = best_size(grown, calibration, draft_ms + level_ms[count - 1], cost, limit, overlap)[1]
        if rate > now:
            best, now = count, rate
    return best


@dataclass
class ShapeHistory:
    """One request's shape inputs: its calibration, the last tree it proposed and how often its
    trees were drafted ahead (prefetch hits, faded like the calibration).

    ``last``: (committed length when drafted, tokens [root first], parents, path probabilities).
    """

    calibration: Calibration = field(default_factory=Calibration)
    last: tuple[int, list[int], list[int], list[float]] | None = None
    hits: float = 0.0  # faded count of steps whose tree was prepared ahead
    calls: float = 0.0  # faded count of steps that could have been (a prefetch ran before them)

    @property
    def overlap(self) -> float:
        """The expected share of steps whose drafting is hidden behind verification, with a prior of
        one miss. Example: none recorded -> 0; three hits in a row -> 2.71 / (2.71 + 1) = 0.73."""
        return self.hits / (self.calls + 1.0)

    def record_prefetch(self, hit: bool) -> None:
        """One step after a prefetch: whether its tree was ready (recorded after the step's tree is
        drafted or installed, so a tree prepared ahead and the normal path's saw the same history)."""
        self.hits = DECAY * self.hits + float(hit)
        self.calls = DECAY * self.calls + 1.0

    def observe(self, committed: Sequence[int]) -> None:
        """One step: fade the history, then score the last proposal against what was committed
        since: the nodes along the committed tokens were accepted, every other node was not.

        Example: last tree r->a->b, r->c drafted at length 5; committed[5:] = [a, d]: a accepted,
        b and c not.
        """
        self.calibration.fade()
        if self.last is None:
            return
        length, tokens, parents, probs = self.last
        self.last = None
        if len(committed) <= length:
            return
        accepted, node = set(), 0
        for token in committed[length:]:
            node = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == token), -1)
            if node < 0:
                break
            accepted.add(node)
        for i in range(1, len(tokens)):
            self.calibration.record(probs[i], i in accepted)


@dataclass
class Backoff:
    """Plain decoding while cost-aware trees keep choosing no nodes (per request).

    A cost-aware tree of the root alone still cost its drafting (the SSM forward that extends its
    cache, the root's expansion). After such a step the cost-aware proposers sit out 1, then 2, 4,
    ... steps (at most ``limit``), and a step whose tree had nodes resets the wait. So a request
    whose trees do not pay (at this load, on this machine) stops paying for drafting and tries
    again ever less often. It reads the request's history only, so outputs stay exact.

    Example (limit 4): drafted steps of 0, 0, 0, 0 nodes -> sit out 1, 2, 4, 4 steps; a step with
    nodes -> drafting every step again.
    """

    limit: int = 16
    wait: int = 0  # how many steps the next sit-out lasts
    left: int = 0  # steps of the current sit-out still to go

    def drafts(self) -> bool:
        """Whether this step's cost-aware proposers draft (counts a skipped step)."""
        if self.left:
            self.left -= 1
            return False
        return True

    def record(self, nodes: int) -> None:
        """A step the cost-aware proposers drafted: ``nodes`` drafted nodes in its tree."""
        self.wait = 0 if nodes else min(self.limit, max(1, 2 * self.wait))
        self.left = self.wait


CARRIED_TOKENS = 4  # accepted tokens, all proposed by a model-free proposer, that let the SSMs sit out


@dataclass
class ModelFreeLead:
    """The cost-aware SSMs sit out while a model-free proposer (the suffix proposer) alone carries
    the request: after a step whose accepted tokens were all proposed by it (the SSMs may have
    proposed them too), at least ``min_tokens`` of them, the next step drafts without the SSMs (no SSM
    forward); they draft again after a step that accepted fewer. On a stretch the suffix proposer
    has seen before (a repeated prompt, text copied from the prompt) the SSMs' drafting adds nothing
    the suffix tree lacks. It reads the request's own verdicts only, so outputs stay exact.

    Example (min_tokens 4, proposer 1 model-free): accepted_by ((0, 1),) * 5 -> carried; then
    ((1,),) * 6 -> carried; then ((1,),) -> not; ((0, 1), (0,), (0, 1), (0, 1)) -> not (token 2 was
    the SSM's alone).
    """

    min_tokens: int = CARRIED_TOKENS
    carried: bool = False

    def record(self, accepted_by: Sequence[Sequence[int]], model_free: frozenset[int]) -> None:
        """One verified step: ``accepted_by[i]`` the proposers of accepted token i."""
        self.carried = len(accepted_by) >= self.min_tokens and all(model_free.intersection(p) for p in accepted_by)
