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
   ``chunk_tokens`` prompt tokens, the earliest requests first);
5. **commit**: per request, verification with its own generator (so its output does not depend on
   who else runs), commit of the accepted path, tokens to its outbox.

Nothing waits on a clock: whoever calls ``step`` decides when the next pass runs, so a test steps
the loop by hand. ``stream`` serves one request from a caller's thread, stepping the loop for
everyone while it waits (a lock lets several threads share one loop).

Targets and drafters without a packed forward (a DynamicCache, CUDA graphs, tensor-parallel ranks)
run their items one by one (``engine.programs.ALONE``): the same phases, unbatched.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .budget import RunningLoad
from .draft import ModelDrafter
from .kv_pool import PoolExhausted
from .paged_models import PagedTarget
from .programs import Running, run_round, run_rounds, start
from .requests import GenerationRequest, StepOutcome, StepUpdate
from .sampling import make_generator
from .shape import TreeCost
from .step import (TARGET_STREAM, Drafted, Session, StepPlan, draft_with, first_token, merge_drafts, plan_proposers,
                   root_only_proposal, tree_reservation, verify_program)
from .target import Target

PHASES = ("schedule", "draft", "merge", "verify", "commit")  # where an iteration's time goes (IterationStats.ms)


class QueueFull(RuntimeError):
    """The loop's waiting queue is full (``LoopLimits.max_waiting``): the request is refused."""


@dataclass(frozen=True)
class LoopLimits:
    """``max_running``: requests stepped together; ``max_waiting``: requests queued beyond them before
    ``submit`` refuses (QueueFull); ``chunk_tokens``: prompt tokens one target pass takes, all
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
    use (None without a pool), drafted and accepted tokens, the passes it ran, and ms per phase."""

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
    target_passes: int
    draft_rounds: int
    ms: dict[str, float]


@dataclass
class LoopRequest:
    """A request as the loop holds it: its session (plan, statistics, text), its states on the target
    and on each proposer, its target generator, its prefill under way, and its outbox."""

    id: int
    request: GenerationRequest
    session: Session | None = None
    target_state: object | None = None
    proposer_states: dict[int, object] = field(default_factory=dict)
    generator: torch.Generator | None = None
    prefill: Running | None = None
    prompt_left: int = 0
    outbox: deque = field(default_factory=deque)
    error: BaseException | None = None
    finished: bool = False


class EngineLoop:
    """The loop over one target and its proposers (in proposer order). ``cost``: the cost model of
    cost-aware shapes (None: schedules); ``tree_budget(running)``: the most nodes a tree may have
    with that many running requests (None: the request's own limit)."""

    def __init__(self, target: Target, drafters: Sequence[object], tokenizer, eos_ids,
                 limits: LoopLimits = LoopLimits(), cost: TreeCost | None = None,
                 tree_budget: Callable[[int], int | None] | None = None):
        self.target, self.drafters, self.tokenizer = target, list(drafters), tokenizer
        self.eos_ids, self.limits, self.cost, self.tree_budget = frozenset(eos_ids), limits, cost, tree_budget
        self.names = tuple(d.name for d in self.drafters)
        self.neural = tuple(isinstance(d, ModelDrafter) for d in self.drafters)
        self.load = RunningLoad() if cost is not None else None
        self.waiting: deque[LoopRequest] = deque()
        self.running: list[LoopRequest] = []
        self.requests: dict[int, LoopRequest] = {}
        self.iterations = 0
        self.last: IterationStats | None = None
        self.observers: list[Callable[[IterationStats], None]] = []
        self.lock = threading.RLock()  # callers on several threads step the one loop in turn
        self._ids = itertools.count()
        self._emitted = 0  # tokens pushed to outboxes in the iteration under way

    # -- The caller's side. -------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; its id. QueueFull when ``max_waiting`` requests already wait."""
        with self.lock:
            if len(self.waiting) >= self.limits.max_waiting:
                raise QueueFull(f"server busy: {len(self.waiting)} requests waiting "
                                f"(limit {self.limits.max_waiting}); retry later")
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
        """Drop a request wherever it is (idempotent); its states go back at once."""
        with self.lock:
            entry = self.requests.pop(request_id, None)
            if entry is None or entry.finished:
                return
            if entry in self.waiting:
                self.waiting.remove(entry)
            self._finish(entry)

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

    @torch.inference_mode()
    def step(self) -> IterationStats:
        """Run one iteration over every running request (see the module's docstring)."""
        with self.lock:
            clock, self._emitted = _PhaseClock(), 0
            self.running = [r for r in self.running if not r.finished]  # cancelled since the last iteration
            self._admit()
            decoding = [r for r in self.running if r.prefill is None]
            plans = {r.id: r.session.plan_step() for r in decoding}
            clock.lap("schedule")
            drafts, rounds = self._draft(decoding, plans)
            decoding = [r for r in decoding if r.error is None]  # a failed draft ends its request alone
            clock.lap("draft")
            merged = {r.id: self._merge(r, drafts[r.id], clock.ms["draft"]) for r in decoding}
            clock.lap("merge")
            verifying = {r.id: start(verify_program(self.target, r.target_state, merged[r.id], r.request.sampling,
                                                    r.generator)) for r in decoding}
            chunks = self._chunks_this_pass()
            passes = run_round(list(verifying.values()) + [r.prefill for r in chunks])
            clock.lap("verify")
            counts = self._commit(decoding, plans, verifying, chunks, clock.ms)
            clock.lap("commit")
            return self._record(counts, passes, rounds, clock.ms)

    def _admit(self) -> None:
        """Waiting requests join, in order, while the batch limit and the target's pool allow."""
        while self.waiting and len(self.running) < self.limits.max_running:
            entry = self.waiting[0]
            try:
                entry.target_state = self.target.new_state(self._reservation(entry.request))
            except PoolExhausted as error:
                if self.running:
                    return  # it waits for blocks the running requests give back
                self.waiting.popleft()  # it cannot fit even alone
                self._fail(entry, error)
                continue
            self.waiting.popleft()
            self._start(entry)

    def _start(self, entry: LoopRequest) -> None:
        request = entry.request
        budget = None if self.tree_budget is None else (lambda: self.tree_budget(len(self.running)))
        entry.session = Session(None, request, self.names, self.neural, self.tokenizer, self.eos_ids,
                                budget or (lambda: None), self.cost, self.load)
        entry.generator = make_generator(request.sampling.seed, TARGET_STREAM)
        entry.prefill = start(self.target.prefill_program(entry.target_state, list(request.prompt_ids),
                                                          self.limits.chunk_tokens))
        entry.prompt_left = len(request.prompt_ids)
        self.running.append(entry)
        if entry.prefill.error is not None:
            self._fail(entry, entry.prefill.error)

    def _reservation(self, request: GenerationRequest) -> int:
        """KV entries a request can need at most: prompt, new tokens and one step's merged tree."""
        plan = plan_proposers(self.names, self.neural, request.speculation, request.sampling, self.cost)
        return len(request.prompt_ids) + request.max_new_tokens + tree_reservation(plan)

    def _draft(self, decoding: list[LoopRequest], plans: dict[int, StepPlan]) -> tuple[dict[int, dict], int]:
        """Every planned proposer's tree per request ({request: {proposer: Drafted}}) and the rounds
        run: neural SSMs together, one packed forward per SSM per tree level."""
        drafts: dict[int, dict[int, Drafted]] = {r.id: {} for r in decoding}
        programs: list[tuple[LoopRequest, int, Running]] = []
        for r in decoding:
            committed = r.session.committed
            for assignment in plans[r.id].assignments:
                drafter, state = self.drafters[assignment.proposer], self._proposer_state(r, assignment.proposer)
                generator = assignment.generator(len(committed))
                if self.neural[assignment.proposer]:
                    program = drafter.draft_program(state, committed, assignment.spec, generator)
                    programs.append((r, assignment.proposer, start(program)))
                else:
                    drafts[r.id][assignment.proposer] = draft_with(drafter, state, committed, assignment.spec, generator)
        rounds = run_rounds([running for _, _, running in programs])
        for r, proposer, running in programs:
            if running.error is not None:
                self._fail(r, running.error)
            else:
                drafts[r.id][proposer] = Drafted(running.result)
        return drafts, rounds

    def _proposer_state(self, entry: LoopRequest, proposer: int):
        if proposer not in entry.proposer_states:
            entry.proposer_states[proposer] = self.drafters[proposer].new_state()
        return entry.proposer_states[proposer]

    def _merge(self, entry: LoopRequest, drafts: dict[int, Drafted], draft_ms: float) -> Drafted:
        if entry.error is not None or not drafts:
            return Drafted(root_only_proposal(entry.session.committed[-1]), draft_ms)
        return merge_drafts([drafts[p] for p in sorted(drafts)], entry.session.committed[-1], draft_ms)

    def _chunks_this_pass(self) -> list[LoopRequest]:
        """The prefilling requests whose next chunk joins this pass: in admission order, while their
        prompt tokens stay within ``chunk_tokens`` (the first always goes)."""
        chosen, total, limit = [], 0, self.limits.chunk_tokens
        for r in self.running:
            if r.prefill is None or r.prefill.done:
                continue
            size = min(r.prompt_left, limit or r.prompt_left)
            if chosen and limit is not None and total + size > limit:
                break
            chosen.append(r)
            total += size
        return chosen

    def _commit(self, decoding, plans, verifying, chunks, ms) -> dict[str, int]:
        """Each request's outcome to its outbox; the finished leave. Returns the iteration's counts."""
        counts = dict.fromkeys(("drafted", "accepted", "emitted", "prompt"), 0)
        wall_ms = sum(ms.values())
        for r in decoding:
            running = verifying[r.id]
            if r.error is None and running.error is not None:
                self._fail(r, running.error)
            if r.error is not None:
                continue
            outcome: StepOutcome = running.result
            counts["drafted"] += outcome.draft_tokens
            counts["accepted"] += len(outcome.tokens) - 1
            self._push(r, r.session.finish_step(plans[r.id], outcome, wall_ms))
        for r in chunks:
            counts["prompt"] += min(r.prompt_left, self.limits.chunk_tokens or r.prompt_left)
            self._prefilled(r)
        counts["emitted"] = self._emitted
        return counts

    def _prefilled(self, entry: LoopRequest) -> None:
        """After a prompt chunk: its first token once the whole prompt is in."""
        prefill = entry.prefill
        entry.prompt_left = max(0, entry.prompt_left - (self.limits.chunk_tokens or entry.prompt_left))
        if prefill.error is not None:
            self._fail(entry, prefill.error)
        elif prefill.done:
            entry.prefill = None
            first = first_token(prefill.result, entry.request.sampling, entry.generator)
            self._push(entry, entry.session.start(first))

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
        if entry.target_state is not None:
            self.target.release(entry.target_state)
        for proposer, state in entry.proposer_states.items():
            self.drafters[proposer].release(state)
        entry.proposer_states = {}
        if entry.prefill is not None and not entry.prefill.done:
            entry.prefill.program.close()

    def _record(self, counts: dict[str, int], passes: int, rounds: int, ms: dict[str, float]) -> IterationStats:
        self.running = [r for r in self.running if not r.finished]
        used = total = None
        if isinstance(self.target, PagedTarget):
            used, total = self.target.pool.num_blocks - self.target.pool.num_free, self.target.pool.num_blocks
        self.iterations += 1
        self.last = IterationStats(self.iterations, len(self.running), len(self.waiting),
                                   sum(r.prefill is not None for r in self.running), used, total,
                                   counts["drafted"], counts["accepted"], counts["emitted"], counts["prompt"],
                                   passes, rounds, dict(ms))
        for observer in self.observers:
            observer(self.last)
        return self.last


class _PhaseClock:
    """ms per phase of one iteration: ``lap(phase)`` books the time since the last lap."""

    def __init__(self):
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] += (now - self._last) * 1e3
        self._last = now
