"""One engine loop that owns every running request and steps them together (vLLM v1's EngineCore).

Requests are data here, not threads: ``submit`` queues one, ``step`` runs one iteration for all of
them, and each request's updates wait in its outbox until ``take`` collects them. An iteration:

1. **schedule**: admit waiting requests, first come first served, while the batch limit
   (``LoopLimits.max_running``) and the target's KV pool (the request's worst case reserved) allow;
   each request plans its step (``Session.plan_step``: tree size by goodput against the others'
   load, zero nodes allowed);
2. **draft**: every neural SSM drafts all planned trees together, one packed forward per tree level
   for the whole batch (``engine.programs.run_rounds``); the model-free proposers beside them;
3. **merge**: each request's drafts folded into one tree, in proposer order;
4. **verify**: one packed target pass over every tree and this iteration's prompt chunks (at most
   ``chunk_tokens`` prompt tokens, the least prompt left first, with aging: ``prefill_order``);
5. **commit**: per request, verification with its own generator (so its output does not depend on
   who else runs), commit of the accepted path, tokens to its outbox.

Nothing waits on a clock: whoever calls ``step`` decides when the next pass runs, so a test steps
the loop by hand. ``stream`` serves one request from a caller's thread, stepping the loop for
everyone while it waits (a lock lets several threads share one loop).

Where the models run is the ``Executor``'s business: ``engine.phases.LocalExecutor`` runs
them in this process (targets and drafters without a packed forward, such as a DynamicCache, CUDA
graphs or tensor-parallel ranks, run their items one by one: the same phases, unbatched); an
executor over Ray actors sends each phase to them as one call per actor. The core is async so that
a remote executor can await its actors; ``step`` drives it where the executor never suspends.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .budget import RunningLoad
from .draft_gate import Candidate, DraftGate, Sample
from .kv_pool import PoolExhausted
from .requests import GenerationRequest, StepOutcome, StepUpdate
from .shape import TreeCost
from .step import Assignment, Session, StepPlan, plan_proposers, run_sync, tree_reservation

PHASES = ("schedule", "draft", "verify", "commit")  # where an iteration's time goes (IterationStats.ms)


class QueueFull(RuntimeError):
    """The loop's waiting queue is full (``LoopLimits.max_waiting``): the request is refused."""


@dataclass(frozen=True)
class LoopLimits:
    """``max_running``: requests stepped together; ``max_waiting``: requests queued beyond them (the
    free running places count as taken) before ``submit`` refuses (QueueFull); ``chunk_tokens``: prompt tokens one target pass takes, all
    prefilling requests together (the first chunk always goes; None: whole prompts)."""

    max_running: int = 8
    max_waiting: int = 64
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError(f"max_running must be >= 1 and max_waiting >= 0, got {self.max_running}, "
                             f"{self.max_waiting}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {self.chunk_tokens}")


@dataclass(frozen=True)
class IterationStats:
    """One iteration, for metrics: requests running and waiting after it, the target's KV blocks in
    use (None without a pool), drafted, accepted, emitted and prompt tokens, ms per phase
    (draft: drafting and merging, with their transport where they run in actors; verify: the target
    pass, verification and commit, with its call), and the requests verified with at least one
    draft token (vLLM's ``num_drafts``)."""

    iteration: int
    running: int
    waiting: int
    prefilling: int
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    drafted_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    prompt_tokens: int
    ms: dict[str, float]
    drafts: int = 0
    draft_limit: int | None = None  # the draft gate's limit after the iteration (None: no gate)


@dataclass(frozen=True)
class DraftJob:
    """One request's drafting this iteration: its committed tokens (the root last) and who drafts."""

    request_id: int
    committed: tuple[int, ...]
    assignments: tuple[Assignment, ...]


class Executor(Protocol):
    """Where the models run: each request's states, and the iteration's phases for all requests at
    once. ``names`` / ``neural``: the proposers in proposer order (neural: a model); ``windows``:
    the most committed tokens each one's first draft of a request takes in (``ssms[].context_tokens``;
    None: all of them)."""

    names: tuple[str, ...]
    neural: tuple[bool, ...]
    windows: tuple[int | None, ...]

    def admit(self, request_id: int, request: GenerationRequest, reserve_tokens: int) -> bool:
        """Create the request's states, reserving ``reserve_tokens`` of KV memory, and start its
        prefill (in chunks of the loop's ``chunk_tokens``); False while the memory is not there."""

    async def draft(self, jobs: list[DraftJob]) -> object:
        """Every job's proposers draft and the drafts are merged per request, in proposer order: a
        handle that ``verify`` takes (the merged trees, or where they will be)."""

    async def verify(self, drafted: object, trees: list[int], chunks: list[int]) -> dict[int, object]:
        """One target pass over the ``trees`` requests' merged trees and the next prompt chunk of
        each ``chunks`` request; per request: a StepOutcome (tree), the first token (int, a prompt
        now in) or None (more chunks to come), or the exception that ends that request alone."""

    def draft_wait_ms(self) -> float:
        """ms of the last ``verify`` call that went to waiting for its drafts: where ``draft`` only
        sends the calls (actors), the verifier's call waits for the SSMs and the merge actor, their
        transport included; 0.0 where ``draft`` finished them. The loop books it as draft time."""

    def release(self, request_id: int) -> None:
        """Drop the request's states everywhere (idempotent)."""

    def kv_blocks(self) -> tuple[int, int] | None:
        """(used, total) blocks of the target's KV pool; None without one."""


@dataclass
class LoopRequest:
    """A request as the loop holds it: its session (plan, statistics, text), what is left of its
    prompt to feed, and its outbox (its states live in the executor)."""

    id: int
    request: GenerationRequest
    session: Session | None = None
    prompt_left: int = 0
    outbox: deque = field(default_factory=deque)
    error: BaseException | None = None
    finished: bool = False
    passed_over: int = 0  # passes that took other prompts' chunks while this one waited for its next
    drafted_at: int = 0  # committed tokens when its cost-aware SSMs last drafted (what they hold)

    @property
    def prefilling(self) -> bool:
        return self.prompt_left > 0


class EngineLoop:
    """The loop over an executor (``engine.phases.local_loop`` builds one over models in
    this process). ``cost``: the cost model of cost-aware shapes (None: schedules);
    ``tree_budget(running)``: the most nodes a tree may have with that many running requests (None:
    the request's own limit); ``draft_gate``: with ``cost``, how many requests draft is measured
    (``engine.draft_gate``; False: all that plan to)."""

    def __init__(self, executor: Executor, tokenizer, eos_ids, limits: LoopLimits = LoopLimits(),
                 cost: TreeCost | None = None, tree_budget: Callable[[int], int | None] | None = None,
                 draft_gate: bool = True):
        self.executor, self.tokenizer = executor, tokenizer
        self.eos_ids, self.limits, self.cost, self.tree_budget = frozenset(eos_ids), limits, cost, tree_budget
        self.names, self.neural, self.windows = executor.names, executor.neural, executor.windows
        self.load = RunningLoad() if cost is not None else None
        self.gate = DraftGate(cost, most=limits.max_running) if cost is not None and draft_gate else None
        self.waiting: deque[LoopRequest] = deque()
        self.running: list[LoopRequest] = []
        self.requests: dict[int, LoopRequest] = {}
        self.iterations = 0
        self.last: IterationStats | None = None
        self.observers: list[Callable[[IterationStats], None]] = []
        self.lock = threading.RLock()  # callers on several threads step the one loop in turn
        self._ids = itertools.count()
        self._emitted = 0  # tokens pushed to outboxes in the iteration under way
        self._in_pass: set[int] = set()  # requests in the executor's phases now (an async step awaits them)
        self._release_after: list[int] = []  # finished while in the pass: their states go back after it

    # -- The caller's side. -------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; its id. QueueFull when ``max_waiting`` requests already wait."""
        with self.lock:
            free = max(0, self.limits.max_running - len(self.running))  # taken at the next iteration
            if len(self.waiting) >= self.limits.max_waiting + free:
                raise QueueFull(f"server busy: {len(self.waiting) - free} requests waiting beyond the "
                                f"{self.limits.max_running} running (limit {self.limits.max_waiting}); retry later")
            entry = LoopRequest(next(self._ids), request)
            self.requests[entry.id] = entry
            self.waiting.append(entry)
            return entry.id

    def take(self, request_id: int) -> list[StepUpdate]:
        """The request's updates since the last call; raises the request's error once they are out.
        The request is forgotten once its last update (with a finish reason) is taken."""
        with self.lock:
            entry = self.requests[request_id]
            updates = list(entry.outbox)
            entry.outbox.clear()
            if entry.finished and not updates:  # an error's updates are taken first, then the error
                self.requests.pop(request_id, None)
                if entry.error is not None:
                    raise entry.error
            elif updates and updates[-1].finish_reason is not None:
                self.requests.pop(request_id, None)
            return updates

    def cancel(self, request_id: int) -> None:
        """Drop a request wherever it is (idempotent); its states go back at once, or after the
        pass it is part of (a cancel from another task while ``step_async`` awaits the executor)."""
        with self.lock:
            entry = self.requests.pop(request_id, None)
            if entry is None or entry.finished:
                return
            if entry in self.waiting:
                self.waiting.remove(entry)
            self._finish(entry)

    def abort(self, error: BaseException) -> None:
        """End every request, waiting or running, with ``error`` (an iteration failed as a whole)."""
        with self.lock:
            for entry in [*self.waiting, *self.running]:
                self._fail(entry, error)
            self.waiting.clear()
            self.running = []

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stream(self, request: GenerationRequest) -> Iterator[StepUpdate]:
        """One request's updates, stepping the loop (for everyone) whenever this one has none."""
        request_id, done = self.submit(request), False
        try:
            while not done:
                with self.lock:
                    updates = self.take(request_id)
                    if not updates:
                        self.step()
                for update in updates:
                    done = update.finish_reason is not None
                    yield update
        finally:
            if not done:
                self.cancel(request_id)

    # -- One iteration. -----------------------------------------------------------------------

    def step(self) -> IterationStats:
        """One iteration, where the executor never suspends (in this process)."""
        return run_sync(self.step_async())

    @torch.inference_mode()
    async def step_async(self) -> IterationStats:
        """Run one iteration over every running request (see the module's docstring)."""
        with self.lock:
            clock, self._emitted = _PhaseClock(), 0
            self.running = [r for r in self.running if not r.finished]  # cancelled since the last iteration
            self._admit()
            decoding, chunks = [r for r in self.running if not r.prefilling], self._chunks_this_pass()
            plans, catch_up = self._gated({r.id: r.session.plan_step() for r in decoding}, decoding, clean=not chunks)
            clock.lap("schedule")
            self._in_pass = {r.id for r in decoding + chunks}
            try:
                jobs = [DraftJob(r.id, tuple(r.session.committed), plans[r.id].assignments) for r in decoding]
                drafted = await self.executor.draft(jobs)
                clock.lap("draft")
                results = await self.executor.verify(drafted, [r.id for r in decoding], [r.id for r in chunks])
                clock.lap("verify")
                clock.move("verify", "draft", self.executor.draft_wait_ms())
            finally:
                self._in_pass = set()
                for request_id in self._release_after:
                    self.executor.release(request_id)
                self._release_after = []
            counts = self._commit(decoding, plans, chunks, results, clock.ms)
            clock.lap("commit")
            self._observe(decoding, plans, counts, clock.ms, catch_up)
            return self._record(counts, clock.ms)

    def _gated(self, plans: dict[int, StepPlan], decoding: list[LoopRequest],
               clean: bool) -> tuple[dict[int, StepPlan], int]:
        """The plans with the cost-aware proposers left out of the requests the draft gate holds back,
        and the committed tokens the SSMs of the requests that draft for the first time since the last
        iteration lack (their catch-up). A request that drafts has its ``drafted_at`` moved to now."""
        if self.gate is None:
            return plans, 0
        candidates = [Candidate(r.id, self._lag(r, plans[r.id]), r.request.max_new_tokens - r.session.stats.new_tokens,
                                r.id in self.gate.drafters)
                      for r in decoding if plans[r.id].cost_aware]
        allowed = self.gate.choose(candidates, len(decoding), clean)
        catch_up = sum(c.lag for c in candidates if c.request_id in allowed and not c.drafted_last)
        for r in decoding:
            plan = plans[r.id]
            if plan.cost_aware and r.id not in allowed:
                plans[r.id] = StepPlan(tuple(a for a in plan.assignments if not a.spec.cost_aware))
            elif plan.cost_aware:
                r.drafted_at = len(r.session.committed)
        return plans, catch_up

    def _lag(self, entry: LoopRequest, plan: StepPlan) -> int:
        """Committed tokens the request's cost-aware SSMs lack: those since their last draft; before
        its first, as many as the widest of their windows takes in (``Executor.windows``; the whole
        context where one has none). Example: 300 committed, never drafted, a window of 64 -> 64
        (without one: 300); drafted at 290 -> 10."""
        committed = len(entry.session.committed)
        if entry.drafted_at:
            return committed - entry.drafted_at
        windows = [self.windows[a.proposer] for a in plan.assignments if a.spec.cost_aware]
        return committed if None in windows or not windows else min(committed, max(windows))

    def _observe(self, decoding: list[LoopRequest], plans: dict[int, StepPlan], counts: dict[str, int],
                 ms: dict[str, float], catch_up: int) -> None:
        """The iteration, to the draft gate."""
        if self.gate is None:
            return
        drafters = frozenset(r.id for r in decoding if plans[r.id].cost_aware)
        self.gate.observe(drafters, Sample(len(decoding), counts["drafted"], counts["accepted"], counts["prompt"],
                                           ms["draft"], ms["verify"], catch_up))

    def _admit(self) -> None:
        """Waiting requests join, in order, while the batch limit and the KV memory allow."""
        while self.waiting and len(self.running) < self.limits.max_running:
            entry = self.waiting[0]
            try:
                admitted = self.executor.admit(entry.id, entry.request, self._reservation(entry.request))
            except Exception as error:  # the request's own fault (its prompt, say): it fails alone
                self.waiting.popleft()
                self._fail(entry, error)
                continue
            if not admitted and self.running:
                return  # it waits for the memory the running requests give back
            self.waiting.popleft()
            if not admitted:  # it cannot fit even alone
                self._fail(entry, PoolExhausted(f"the request needs {self._reservation(entry.request)} tokens of "
                                                "KV cache (prompt + max_new_tokens + tree), more than the pool holds"))
                continue
            self._start(entry)

    def _start(self, entry: LoopRequest) -> None:
        request = entry.request
        budget = None if self.tree_budget is None else (lambda: self.tree_budget(len(self.running)))
        entry.session = Session(None, request, self.names, self.neural, self.tokenizer, self.eos_ids,
                                budget or (lambda: None), self.cost, self.load)
        entry.prompt_left = len(request.prompt_ids)
        self.running.append(entry)

    def _reservation(self, request: GenerationRequest) -> int:
        """KV entries a request can need at most: prompt, new tokens and one step's merged tree."""
        plan = plan_proposers(self.names, self.neural, request.speculation, request.sampling, self.cost)
        return len(request.prompt_ids) + request.max_new_tokens + tree_reservation(plan)

    def _chunks_this_pass(self) -> list[LoopRequest]:
        """The prefilling requests whose next chunk joins this pass: in ``prefill_order``, each whose
        chunk still fits within ``chunk_tokens`` (the first always goes); the others age by a pass."""
        prefilling = [r for r in self.running if r.prefilling and not r.finished]
        chosen, total, limit = [], 0, self.limits.chunk_tokens
        for r in prefill_order(prefilling, limit):
            size = min(r.prompt_left, limit or r.prompt_left)
            if chosen and limit is not None and total + size > limit:
                r.passed_over += 1
                continue
            chosen.append(r)
            total += size
        return chosen

    def _commit(self, decoding, plans, chunks, results, ms) -> dict[str, int]:
        """Each request's result to its outbox; the finished leave. Returns the iteration's counts."""
        counts = dict.fromkeys(("drafted", "accepted", "emitted", "prompt", "drafts"), 0)
        wall_ms = sum(ms.values())
        for r in decoding:
            result = results.get(r.id)
            if r.finished:  # cancelled while the phases ran
                continue
            if not isinstance(result, StepOutcome):
                self._fail(r, result if isinstance(result, BaseException) else RuntimeError("no verdict"))
                continue
            counts["drafted"] += result.draft_tokens
            counts["drafts"] += result.draft_tokens > 0
            counts["accepted"] += len(result.tokens) - 1
            self._push(r, r.session.finish_step(plans[r.id], result, wall_ms))
        for r in chunks:
            if r.finished:
                continue
            size = min(r.prompt_left, self.limits.chunk_tokens or r.prompt_left)
            counts["prompt"] += size
            r.prompt_left -= size
            self._prefilled(r, results.get(r.id))
        counts["emitted"] = self._emitted
        return counts

    def _prefilled(self, entry: LoopRequest, result) -> None:
        """After a prompt chunk: its first token once the whole prompt is in."""
        if isinstance(result, BaseException):
            self._fail(entry, result)
        elif isinstance(result, int):
            entry.prompt_left = 0
            self._push(entry, entry.session.start(result))
        elif not entry.prefilling:
            self._fail(entry, RuntimeError("the prompt was fed but no first token came back"))

    def _push(self, entry: LoopRequest, update: StepUpdate) -> None:
        entry.outbox.append(update)
        self._emitted += len(update.token_ids)
        if update.finish_reason is not None:
            self._finish(entry)

    def _fail(self, entry: LoopRequest, error: BaseException) -> None:
        """The request ends with ``error`` (raised to its caller by ``take``); the others go on."""
        if entry.error is None:
            entry.error = error
            self._finish(entry)

    def _finish(self, entry: LoopRequest) -> None:
        """Give the request's states back; it leaves the running set after this iteration."""
        if entry.finished:
            return
        entry.finished = True
        if entry.session is not None:
            entry.session.close()
        if entry.id in self._in_pass:
            self._release_after.append(entry.id)
        else:
            self.executor.release(entry.id)

    def _record(self, counts: dict[str, int], ms: dict[str, float]) -> IterationStats:
        self.running = [r for r in self.running if not r.finished]
        used, total = self.executor.kv_blocks() or (None, None)
        self.iterations += 1
        self.last = IterationStats(self.iterations, len(self.running), len(self.waiting),
                                   sum(r.prefilling for r in self.running), used, total,
                                   counts["drafted"], counts["accepted"], counts["emitted"], counts["prompt"],
                                   dict(ms), counts["drafts"], None if self.gate is None else self.gate.limit)
        for observer in self.observers:
            observer(self.last)
        return self.last


def prefill_order(prefilling: Sequence[LoopRequest], chunk_tokens: int | None) -> list[LoopRequest]:
    """Shortest remaining prompt first, so that a burst's median first token does not wait behind
    its longest prompts; each pass a request was passed over counts as one chunk of its prompt fed,
    so a long prompt is not overtaken forever (ties: admission order). Whole prompts (``chunk_tokens``
    None) go in admission order::

        prompt left 300, 40, 90 (admitted in that order), chunk 128 -> 40, 90, 300
        the 300 passed over twice (300 - 2 * 128 = 44) -> 40, 300, 90
    """
    if chunk_tokens is None:
        return list(prefilling)
    return sorted(prefilling, key=lambda r: (r.prompt_left - chunk_tokens * r.passed_over, r.id))


class _PhaseClock:
    """ms per phase of one iteration: ``lap(phase)`` books the time since the last lap."""

    def __init__(self):
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] += (now - self._last) * 1e3
        self._last = now

    def move(self, source: str, target: str, ms: float) -> None:
        """Book ``ms`` of ``source``'s time to ``target`` (clamped to 0 .. all of it)."""
        ms = min(max(ms, 0.0), self.ms[source])
        self.ms[source] -= ms
        self.ms[target] += ms
