"""How many running requests draft this iteration: as many as pay, measured on the batch.

Under load the target's verify pass turns compute-bound and the SSMs' packed forwards cost a
share of it too, so past some batch size drafting costs the batch more than the tokens it adds.
The cost-aware shapes (``engine.shape``) choose each tree's size with the draft already spent;
this gate counts the draft as a cost the batch may avoid: speculation where it pays, plain decoding
where it does not (the issue's "goodput chooses no speculation where it does not pay").

Each iteration at most ``limit`` requests draft with their cost-aware proposers; the others decode
plainly that iteration (model-free proposers still draft). After each *steady* and *clean*
iteration (the requests that began drafting lacked at most ``STEADY_LAG`` tokens of context each;
no prompt chunk in the pass, which would make a few drafted tokens look free) the gate measures what the drafting
bought against plain decoding (``drafting_pays``): the plain pass priced by the verify-cost curve
until a verdict comes out close to 1, then measured in *control* iterations that do not draft
(``CONTROL_EVERY``), and before any verdict that a ``PRICE_ERROR`` in that price would turn
(``hangs_on_price``): its samples wait for a control, which prices them with the one before. A
pass with prompt chunks drafts only at a load where drafting pays. A verdict pools its samples
(``pooled_pays``: their accepted tokens over the plain tokens their drafting's ms would have bought)
once they hold ``MIN_DRAFTED`` drafted tokens (at least
``SAMPLES`` of them, at most ``MAX_SAMPLES``): one request's iteration drafts 0-10 tokens, too few
for a verdict of its own. Paying doubles the limit (where it bound); not paying halves it while it is
above ``START_LIMIT``, else the gate sits out 1, 4, 16, ... iterations (``SIT_OUT_GROWTH``, at most
``max_wait``), then ``START_LIMIT`` requests draft again; only a clear verdict
(``PREDICTION_MARGIN``) that it pays starts the sit-outs over from 1. The floor is there because an
SSM's packed forward costs about as much for one tree as for four: a probe by one request of four
weighs a whole forward against one request's tokens (measured on the default pair at 4 running: one
drafter 0.39-0.82, all four drafting above incremental), so the probe is the batch, not one request
of it. The gate keeps this state per load (the running count's nearest power of two, ``bucket``,
``Load``), so a server that returns to a load it knows resumes what it found there, and a load it has
not measured starts from the nearest one's verdict (``Load.open_like``).

Who drafts when not all may: those that drafted in the iteration before (nothing to catch up),
then the least *lag* (committed tokens the SSMs lack: before a request's first draft, its context
or as much of it as the SSMs' window takes in, ``ssms[].context_tokens``). A request starts only if
its SSMs' catch-up costs no more than drafting saves it over the tokens it may still emit, both
measured (a load without a verdict takes the nearest paying load's saving, ``DraftGate.saving_at``);
before they are, if its lag is at most ``JOIN_RATIO`` x those tokens (``joins``). Where the
load's verdict was that drafting does not pay, only requests that lack at most ``PROBE_LAG`` tokens
draft (probes by requests that drafted lately), or those whose catch-up the load's saving when it
last paid would repay (``DraftGate.probes``): a load whose requests never drafted and never paid
stays closed rather than pay their contexts' catch-up.

It changes who drafts, never what a draft or a verdict is: greedy output stays the target's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .shape import TreeCost
from .timing import moving_average

# Before the gate has measured a catch-up and a saving: committed tokens an SSM may lack per token
# the request may still emit, for it to start drafting. Measured on the default pair (2-core
# AVX512-BF16 EPYC): the int8 SSM ingests 256 tokens in 224 ms (0.9 ms a token); the tree saved 26
# ms per emitted token at 1 stream (84 -> 58 ms) and 5.6 ms at 2 (39.4 -> 33.8 ms a token of the
# batch), so catch-up breaks even at 29 and 6 tokens per token left.
JOIN_RATIO = 8
FADE = 0.5  # ``keep`` of the gate's moving averages (catch-up, draft and saving ms, plain scale)
# A load's plain pass is measured, not guessed, where it can change a decision: once a verdict comes
# out close (within PREDICTION_MARGIN of 1), the next clean iteration that could draft runs without
# drafting (a *control*), and one in every CONTROL_EVERY + 1 after (4x as many while the verdict is
# clear). The verify-cost curve (one request, a 256-token prefix) prices tree tokens too low against
# a batch on long contexts: on 8 ShareGPT requests it put the plain pass at 120 ms where it took 94,
# enough to move a verdict of 0.9 to 1.1 but not past the margin. Before a control the plain pass is
# the curve's price scaled to the iteration's own pass (``plain_ms``), so a clear verdict (one
# request whose drafting buys tokens at 2x the plain rate, say) spends no iteration on a control.
CONTROL_EVERY = 16
PREDICTION_MARGIN = 1.25  # a ratio this far from 1 (either way) is clear: acted on without a probe, fewer controls
# How far a load's plain pass may have moved since it was last measured: a verdict that this much
# either way would turn waits for a control (``hangs_on_price``). Where the plain pass costs several
# times the drafting (16 busy streams, float32 on an AVX2-capped 2-core EPYC: plain 545 ms, drafting
# 90 ms of draft and ~70 of extra verify) a 10% error swings the verdict 2x (replayed samples: plain
# priced at 601 / 575 / 544 / 523 ms -> 2.14 / 1.52 / 1.09 / 0.91), and the box's plain pass moved
# 10-15% between runs and with the running requests' contexts within one.
PRICE_ERROR = 0.1
# Each losing verdict in a row sits out this many times longer. A probe costs its catch-up and a few
# iterations of drafting that does not pay; doubling (1, 2, 4, ... 32), a load where drafting never
# paid spent a fifth of a 130-iteration level probing (default pair, 8 busy streams, served at 0.93x
# incremental with 93% of its steps plain).
SIT_OUT_GROWTH = 4
STEADY_LAG = 4  # a drafter new this iteration that lacks at most this many tokens keeps it steady
START_LIMIT = 4  # requests drafting before anything was measured, and in each probe
SAMPLES = 2  # steady iterations pooled per verdict, at least ...
MAX_SAMPLES = 8  # ... and at most; a verdict once they drafted MIN_DRAFTED tokens or cost MIN_FORGONE
MIN_DRAFTED = 16
MIN_FORGONE = 4.0  # plain tokens (``forgone``): drafting that keeps no node is judged in 2 iterations, not 8
# At a load whose verdict was that drafting does not pay, only requests that lack at most this many
# committed tokens probe: a probe by requests that never drafted pays their whole context's
# catch-up (4 requests of 250 tokens at 0.9 ms: 0.9 s) to measure what the batch already showed.
PROBE_LAG = 16
# A catch-up is priced (``DraftGate.catch_up_ms``) only from iterations whose new drafters fed at
# least this many tokens: below it a deep tree's extra levels look like catch-up (a 5-token catch-up
# beside a 108 ms draft read 17 ms a token, and a lone new request then never joined).
MIN_CATCH_UP = 16


@dataclass(frozen=True)
class Candidate:
    """A decoding request whose plan this iteration has cost-aware proposers."""

    request_id: int
    lag: int  # committed tokens its SSMs lack (before its first draft: its context, or their window of it)
    remaining: int  # tokens it may still emit (max_new_tokens less those emitted)
    drafted_last: bool  # it drafted in the iteration before


@dataclass(frozen=True)
class Sample:
    """One iteration, as the gate reads it: ``decoding`` requests stepped, ``drafted`` tree tokens
    beyond the roots and ``accepted`` of them, ``prompt`` tokens of prompt chunks in the target pass,
    the draft and verify phases' ms."""

    decoding: int
    drafted: int
    accepted: int
    prompt: int
    draft_ms: float
    verify_ms: float
    catch_up: int = 0  # committed tokens the SSMs of drafters new this iteration fed first (their lag)

    @property
    def pass_tokens(self) -> int:
        """Tokens in the target pass: a root per decoding request, the drafted ones, the prompt chunks."""
        return self.decoding + self.drafted + self.prompt

    @property
    def clean(self) -> bool:
        """No prompt chunk in the pass."""
        return not self.prompt


def joins(candidate: Candidate, catch_up_ms: float | None = None, saving_ms: float | None = None) -> bool:
    """Whether ``candidate`` may draft: it drafted last iteration, or its catch-up (``catch_up_ms``
    a token) costs no more than drafting saves over the tokens it may still emit (``saving_ms``
    each); before both are measured, its lag is at most ``JOIN_RATIO`` x those tokens.

    Example: lag 300, 64 tokens left -> True (300 <= 512); lag 330, 30 left -> False; lag 300, 64
    left, 0.9 ms a token of catch-up, 0.65 ms saved a token -> False (270 > 41.6); with 20 ms saved
    -> True; any lag having drafted last iteration -> True.
    """
    if candidate.drafted_last:
        return True
    if catch_up_ms is None or saving_ms is None:
        return candidate.lag <= JOIN_RATIO * candidate.remaining
    return candidate.lag * catch_up_ms <= candidate.remaining * saving_ms


def plain_ms(sample: Sample, cost: TreeCost, plain_scale: float | None = None) -> float:
    """ms the iteration's pass would have taken without its drafted tokens: with ``plain_scale``
    (measured plain passes at this load against the curve) and no prompt chunk in the pass, the
    curve's cost of the decoding requests' tokens times it; else the curve's cost of the rest,
    scaled to this pass (``verify_ms`` against the curve's cost of ``pass_tokens``)."""
    if plain_scale is not None and sample.clean:
        return plain_scale * cost.verify(sample.decoding)
    scale = sample.verify_ms / cost.verify(sample.pass_tokens)
    return scale * cost.verify(max(1, sample.pass_tokens - sample.drafted))


def saving_per_token(sample: Sample, cost: TreeCost, drafters: int, plain_scale: float | None = None) -> float:
    """ms that drafting saved per token a drafting request emitted: each accepted token came at
    the drafting's ms per token instead of the plain pass's, and a drafter emitted 1 + its accepted
    tokens a step; 0 where drafting did not pay. Example: the curve of ``drafting_pays``' example, 8
    decoding and drafting, 8 drafted, 7 accepted, 16 tokens in the pass, draft 43 ms, verify 137 ms:
    plain pass 98.8 ms (12.35 ms a token), drafting_pays 1.065 -> 12.35 x (1 - 1 / 1.065) x 7 / 15
    = 0.35 ms."""
    ratio, accepted = drafting_pays(sample, cost, plain_scale), sample.accepted / max(1, drafters)
    if ratio <= 1.0:
        return 0.0
    return plain_ms(sample, cost, plain_scale) / sample.decoding * (1.0 - 1.0 / ratio) * accepted / (1.0 + accepted)


def forgone(sample: Sample, cost: TreeCost, plain_scale: float | None = None, price: float = 1.0) -> float:
    """The tokens a plain pass would have emitted in the ms the iteration's drafting cost: the draft
    phase and the verify time of the drafted tokens (the pass less ``plain_ms``, times ``price``), at
    the batch's plain rate (decoding requests per that plain pass); negative where the pass took less
    than its plain price. Example: ``drafting_pays``' -> 134.1 ms x 8 / 95.9 = 11.19 tokens; with
    ``price`` 0.9: (230 - 86.3) x 8 / 86.3 = 13.32."""
    plain = price * plain_ms(sample, cost, plain_scale)
    return (sample.draft_ms + sample.verify_ms - plain) * sample.decoding / plain


def drafting_pays(sample: Sample, cost: TreeCost, plain_scale: float | None = None) -> float:
    """The tokens the iteration's drafting bought per ms it cost, as a multiple of the batch's rate
    without it (>= 1: drafting paid): its accepted tokens over the ``forgone`` ones.

    Example: curve ((1, 70), (8, 88), (32, 190)), 8 decoding, 16 drafted, 8 accepted, 24 tokens in
    the pass, draft 60 ms, verify 170 ms: V(24) = 156, scale 1.09, plain pass V(8) = 88 -> 95.9 ms;
    drafting cost 60 + 1.09 x 68 = 134.1 ms for 8 tokens, plain rate 8 / 95.9: 0.72 (it lost).
    """
    return pooled_pays([(sample.accepted, forgone(sample, cost, plain_scale))])


def pooled_pays(samples: Sequence[tuple[int, float]]) -> float:
    """``drafting_pays`` of several iterations together, from their (accepted, ``forgone``) tokens:
    all accepted over all forgone (inf where the drafting cost nothing and bought tokens, 0 where it
    bought none). Example: (1, 0.5), (0, 1.5), (4, 1.0) -> 5 / 3 = 1.67, where the mean of the
    three ratios (2.0, 0.0, 4.0) is 2.0."""
    accepted, cost = sum(a for a, _ in samples), sum(f for _, f in samples)
    if cost <= 0:
        return float("inf") if accepted else 0.0
    return accepted / cost


def hangs_on_price(samples: Sequence[Sample], cost: TreeCost, plain_scale: float | None = None) -> bool:
    """Whether the samples' pooled verdict (``pooled_pays``) is the price's, not the drafting's: it
    comes out on either side of 1 with their plain pass priced ``PRICE_ERROR`` lower or higher
    (``forgone``'s ``price``), or the drafting looks free (its passes took less than the higher price).

    Example: the curve of ``drafting_pays``' example, plain scale 1.0, one sample of 8 decoding, 8
    drafted, 4 accepted, draft 10 ms, verify 100 ms: plain 88 ms, forgone 2.0 tokens, verdict 2.0;
    priced at 79.2 ms 3.11 tokens (1.29), at 96.8 ms 1.09 (3.67): it holds. With 2 accepted the
    verdict is 1.0 and the prices give 0.64 and 1.83: it hangs on the price. With 4 accepted and 80 ms
    in all (cheaper than 96.8): it hangs."""
    def verdict(price: float) -> float:
        return pooled_pays([(s.accepted, forgone(s, cost, plain_scale, price)) for s in samples])
    low, high = verdict(1.0 - PRICE_ERROR), verdict(1.0 + PRICE_ERROR)
    return (low >= 1.0) != (high >= 1.0) or math.isinf(high)


def bucket(running: int) -> int:
    """The load a running count belongs to: its nearest power of two (in log scale), so that 7 running,
    a request of 8 having finished, is the load of 8, not of 4. 1 -> 0, 2 -> 1, 3-5 -> 2, 6-11 -> 3,
    12-22 -> 4, 32 -> 5."""
    return round(math.log2(max(running, 1)))


def plain_ms_per_token(level: int, cost: TreeCost) -> float:
    """ms per token of a plain decode pass at bucket ``level``, read at its smallest running count."""
    return cost.verify(2 ** level) / 2 ** level


@dataclass
class Load:
    """The gate at one load (the running count's nearest power of two, ``bucket``): its limit, its
    sit-out, its samples so far and its last verdict (``ratio``: its samples' mean; None before any)."""

    limit: int = START_LIMIT
    wait: int = 0  # iterations the next sit-out lasts
    left: int = 0  # iterations of the current sit-out still to go
    samples: list[Sample] = field(default_factory=list)  # steady iterations not yet judged
    ratio: float | None = None
    draft_ms: float | None = None  # faded draft ms per drafter in steady iterations
    saving_ms: float | None = None  # faded ``saving_per_token``
    plain_scale: float | None = None  # faded plain pass ms against the curve's (no drafts, no prompt chunks)
    since_control: int = 0  # iterations that could draft since the last control
    awaits_price: bool = False  # ``samples`` hang on the plain pass's price: a control is due (until one runs)
    priced_after: bool = False  # a plain pass was measured since the first of ``samples``

    @property
    def pays(self) -> bool | None:
        return None if self.ratio is None else self.ratio >= 1.0

    @property
    def clear(self) -> bool:
        """The last verdict is beyond ``PREDICTION_MARGIN`` either way (False before any)."""
        return self.ratio is not None and not 1 / PREDICTION_MARGIN <= self.ratio <= PREDICTION_MARGIN

    @property
    def control_every(self) -> int:
        """Drafting iterations between controls: ``CONTROL_EVERY``, 4x that while the verdict is clear."""
        return 4 * CONTROL_EVERY if self.clear else CONTROL_EVERY

    @property
    def control_due(self) -> bool:
        """The next clean iteration that could draft is a control: ``control_every`` drafting
        iterations since the last, a close verdict priced without a measured plain pass, or samples
        waiting for one (``awaits_price``)."""
        close = self.ratio is not None and not self.clear
        return self.since_control >= self.control_every or (self.plain_scale is None and close) or self.awaits_price

    def priced(self, scale: float) -> None:
        """A plain pass was measured at ``scale`` times the curve's price: ``plain_scale`` fades
        towards it (with ``FADE`` 0.5, samples held for it are priced by the mean of the controls
        before and after them). Not replaced by it: priced by one pass alone, verdicts opened the
        gate at 8 and 16 bf16 streams where drafting lost (0.97x and 0.94x incremental)."""
        self.plain_scale = moving_average(self.plain_scale, scale, FADE)
        self.priced_after, self.awaits_price = bool(self.samples), False

    def decide(self, sample: Sample, cost: TreeCost, bound: bool, most: int, max_wait: int) -> None:
        """One steady iteration; a verdict once the samples so far hold ``MIN_DRAFTED`` drafted
        tokens, cost ``MIN_FORGONE`` plain tokens (``forgone`` at ``plain_scale``) or number
        ``MAX_SAMPLES``, ``SAMPLES`` at least, and, where the verdict hangs on the plain pass's price
        (``hangs_on_price``), once a plain pass was measured after them (twice ``MAX_SAMPLES`` wait
        at most): then all of them are priced by the price it leaves (``priced``)."""
        self.samples.append(sample)
        tokens = [(s.accepted, forgone(s, cost, self.plain_scale)) for s in self.samples]
        drafted, spent = sum(s.drafted for s in self.samples), sum(f for _, f in tokens)
        enough = drafted >= MIN_DRAFTED or spent >= MIN_FORGONE or len(self.samples) >= MAX_SAMPLES
        if len(self.samples) < SAMPLES or not enough:
            return
        self.awaits_price = not self.priced_after and len(self.samples) < 2 * MAX_SAMPLES \
            and hangs_on_price(self.samples, cost, self.plain_scale)
        if self.awaits_price:
            return
        self.ratio = pooled_pays(tokens)
        self.samples, self.priced_after = [], False
        if self.pays:
            if self.clear:  # a close verdict keeps the sit-out's length: one lucky pair of samples at a
                self.wait = 0  # load that loses would otherwise bring back probes every other iteration
            self.limit = min(most, 2 * self.limit) if bound else self.limit
        elif self.limit > START_LIMIT:
            self.limit //= 2
        else:
            self.sit_out(min(max_wait, max(1, SIT_OUT_GROWTH * self.wait)))

    def sit_out(self, wait: int) -> None:
        """Nobody drafts for ``wait`` iterations, then ``START_LIMIT`` requests try again."""
        self.wait, self.left, self.limit = wait, wait, START_LIMIT

    def open_like(self, other: "Load", most: int, max_wait: int) -> None:
        """A load met for the first time, started from ``other``'s verdict (the nearest load's): closed
        (sitting out ``max_wait`` / 4 iterations) below 1 / ``PREDICTION_MARGIN``, fully open above
        ``PREDICTION_MARGIN``, else probing with ``START_LIMIT``. The verdict is taken as it is, not
        scaled by the plain rates: with every request drafting, the SSMs' packed forwards and the
        drafted tokens' verify time grow with the batch much as the plain pass does (default pair,
        no gate, tree over incremental: 1.25 at 1 running, 0.96-1.06 at 4, 0.99 at 8, 0.85 at 16)."""
        if other.ratio * PREDICTION_MARGIN < 1.0:
            self.sit_out(max(1, max_wait // 4))
        elif other.ratio > PREDICTION_MARGIN:
            self.limit, self.left = most, 0


@dataclass
class DraftGate:
    """The gate's state (see the module's docstring): one ``Load`` per bucket of the running count;
    ``most``: the largest limit (the batch limit).

    A load without a verdict of its own starts from the nearest load's (``Load.open_like``), or
    with ``START_LIMIT`` where no load has one.
    """

    cost: TreeCost
    most: int = 8
    max_wait: int = 64
    loads: dict[int, Load] = field(default_factory=dict)
    drafters: frozenset[int] = frozenset()  # who drafted in the last iteration
    catch_up_ms: float | None = None  # faded ms an SSM's catch-up costs per token fed
    _load: Load | None = None

    @property
    def limit(self) -> int:
        """The limit at the load of the last iteration: 0 while it sits out (``START_LIMIT`` before any)."""
        if self._load is None:
            return START_LIMIT
        return 0 if self._load.left else self._load.limit

    def choose(self, candidates: Sequence[Candidate], running: int, clean: bool = True) -> frozenset[int]:
        """The requests that draft this iteration with their cost-aware proposers; none in a control
        iteration (``Load.control_due``), which only a ``clean`` pass (no prompt chunk in it) can be;
        in a pass with prompt chunks only those that drafted in the iteration before, and only where
        the load's verdict is that drafting pays: a probe there could not be measured, and requests
        just prefilled would start there, their catch-ups lengthening a long pass. (Default pair, 8
        and 16 ShareGPT requests at once: drafting in those passes, newcomers included, bought its
        tokens at 32-50 ms each against 15 and 11 ms a plain token.)"""
        level = bucket(running)
        load = self.loads.setdefault(level, Load())
        if load is not self._load and load.pays is None and not load.samples:
            self._start_from_neighbours(level, load)
        self._load = load
        if load.left:
            load.left -= 1
            return frozenset()
        if candidates and clean and load.control_due:
            load.since_control = 0
            return frozenset()
        if not clean:  # only where drafting pays, and no catch-up in a pass the batch waits for
            if not load.pays:
                return frozenset()
            candidates = [c for c in candidates if c.drafted_last]
        load.since_control += bool(candidates)
        if load.pays is False:  # a probe, or a limit on its way down
            admissible = [c for c in candidates if self.probes(c, load)]
        else:
            saving = self.saving_at(level)
            admissible = [c for c in candidates if joins(c, self.catch_up_ms, saving)]
        ready = sorted(admissible,
                       key=lambda c: (not c.drafted_last, c.lag, c.request_id))
        return frozenset(c.request_id for c in ready[:load.limit])

    def observe(self, drafters: frozenset[int], sample: Sample) -> None:
        """After the iteration: ``drafters`` drafted; a steady iteration's ``sample`` is measured where
        no prompt chunk was in the pass (a pass busy with prompts makes any extra token look cheap),
        and one whose new drafters caught up ``MIN_CATCH_UP`` tokens or more gives the catch-up's ms
        per token (its draft ms beyond a steady iteration's per drafter)."""
        steady = bool(drafters) and sample.catch_up <= STEADY_LAG * len(drafters - self.drafters)
        self.drafters, load = drafters, self._load
        if load is None:
            return
        if not drafters:  # a plain pass (model-free proposers' tokens aside): its cost against the curve's
            if sample.decoding and sample.clean:
                scale = sample.verify_ms / self.cost.verify(sample.pass_tokens)
                load.priced(scale)
            return
        if steady and sample.clean:
            scale = load.plain_scale
            saving = saving_per_token(sample, self.cost, len(drafters), scale)
            load.draft_ms = moving_average(load.draft_ms, sample.draft_ms / len(drafters), FADE)
            load.saving_ms = moving_average(load.saving_ms, saving, FADE)
            load.decide(sample, self.cost, len(drafters) >= load.limit, self.most, self.max_wait)
        elif sample.catch_up >= MIN_CATCH_UP and load.draft_ms is not None:
            extra = max(0.0, sample.draft_ms - load.draft_ms * len(drafters))
            self.catch_up_ms = moving_average(self.catch_up_ms, extra / sample.catch_up, FADE)

    def probes(self, candidate: Candidate, load: Load) -> bool:
        """Whether ``candidate`` may draft at ``load``, whose verdict was that drafting does not pay:
        it lacks at most ``PROBE_LAG`` tokens (or drafted last iteration), or its catch-up costs no
        more than the load's saving when it last paid would save it (``Load.saving_ms``, faded
        towards 0 by the losing samples since). The latter lets a lone new request probe at 1
        running (26 ms saved a token) and keeps new requests from probing at 8 (under 1 ms)."""
        if candidate.drafted_last or candidate.lag <= PROBE_LAG:
            return True
        return bool(load.saving_ms) and self.catch_up_ms is not None and joins(candidate, self.catch_up_ms,
                                                                                 load.saving_ms)

    def saving_at(self, level: int) -> float | None:
        """ms drafting saves per emitted token at bucket ``level``, for ``joins``: the load's own where
        it pays; where it has no verdict yet, the nearest paying load's, scaled by the two loads' plain
        ms per token (each bucket read at 2 ** bucket running); None where it did not pay (probes go by
        ``PROBE_LAG``) or with nothing measured (``JOIN_RATIO`` decides). When a load without a
        verdict went by ``JOIN_RATIO``, a load of 8 met after one of 4 let every new request catch its
        prompt up for a saving it did not have (default pair, 64-token requests: 586 tokens, 630 ms,
        in one iteration).

        Example: curve ((1, 70), (8, 88), (32, 190)), 4-7 running paying with 2.0 ms saved a token
        -> at 8-15 running 2.0 x (88 / 8) / (77.7 / 4) = 1.13 ms."""
        load = self.loads.get(level)
        if load is not None and load.ratio is not None:
            return load.saving_ms if load.pays else None
        paying = [(abs(b - level), b, other.saving_ms) for b, other in self.loads.items()
                  if other.pays and other.saving_ms is not None]
        if not paying:
            return None
        _, at, saving = min(paying)
        return saving * plain_ms_per_token(level, self.cost) / plain_ms_per_token(at, self.cost)

    def _start_from_neighbours(self, level: int, load: Load) -> None:
        """A load without a verdict, entered: closed, open or probing, by the nearest verdict."""
        measured = [(abs(b - level), b, other) for b, other in self.loads.items() if other.ratio is not None]
        if measured:
            load.open_like(min(measured, key=lambda m: m[:2])[2], self.most, self.max_wait)
