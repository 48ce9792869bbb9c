"""The in-process engine: the speculative step of ``engine.step`` over models in this process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from .draft import ModelDrafter
from .graphed_models import GraphedTarget
from .phases import local_loop
from .loop import LoopLimits
from .prefetch import Ahead
from .requests import GenerationRequest, GenerationResult, StepOutcome, StepUpdate
from .step import (TARGET_STREAM, Assignment, Drafted, Session, draft_with, first_token, iterate_sync,
                   merge_drafts, verify_and_commit)
from .sampling import make_generator
from .shape import TreeCost
from .target import Target


class LocalBackend:
    """A request's states in this process: the target's and each proposer's.

    Prefetch (``SpeculationOptions.prefetch`` > 0): after each SSM's draft, a thread of the engine's
    drafts ahead for the step's guessed outcomes while this thread merges and verifies
    (``engine.prefetch.Ahead``; on CUDA on the drafter's own stream).
    """

    def __init__(self, engine: "SpeculativeEngine", request: GenerationRequest):
        self.engine, self.sampling = engine, request.sampling
        self.prefetch = request.speculation.prefetch
        self.target_state = engine.target.new_state()
        self.generator = make_generator(request.sampling.seed, TARGET_STREAM)
        self.proposers: dict[int, object] = {}  # proposer -> its state, made on first use
        self.ahead: dict[int, Ahead] = {}  # proposer -> its drafting ahead (with prefetch)

    async def prefill(self, prompt_ids: list[int]) -> int:
        logits = self.engine.target.prefill(self.target_state, prompt_ids)  # [V]
        return first_token(logits, self.sampling, self.generator)

    async def draft(self, committed: list[int], plan: Sequence[Assignment]) -> Drafted:
        drafts = []
        for assignment in plan:
            drafter = self.engine.drafters[assignment.proposer]
            if assignment.proposer not in self.proposers:
                self.proposers[assignment.proposer] = drafter.new_state()
            state = self.proposers[assignment.proposer]
            if self.prefetch and isinstance(drafter, ModelDrafter):
                drafts.append(self._draft_ahead(drafter, state, committed, assignment))
            else:
                drafts.append(draft_with(drafter, state, committed, assignment.spec,
                                         assignment.generator(len(committed))))
        return merge_drafts(drafts, committed[-1], sum(d.draft_ms for d in drafts))  # drafted one after another

    def _draft_ahead(self, drafter: ModelDrafter, state, committed: list[int], assignment: Assignment) -> Drafted:
        """The prepared tree or a new one, then a prefetch on the engine's pool."""
        ahead = self.ahead.setdefault(assignment.proposer, Ahead())
        return ahead.draft(drafter, state, committed, assignment, self.prefetch, self.engine.pool)

    async def verify(self, drafted: Drafted) -> StepOutcome:
        return verify_and_commit(self.engine.target, self.target_state, drafted, self.sampling, self.generator)

    def release(self) -> None:
        """Give the target's and every proposer's state back (paged KV blocks return to their pool),
        once no prefetch runs on it."""
        self.engine.target.release(self.target_state)
        for proposer, state in self.proposers.items():
            if proposer in self.ahead:
                self.ahead[proposer].release(self.engine.drafters[proposer], state)
            self.engine.drafters[proposer].release(state)
        self.proposers, self.ahead = {}, {}


class SpeculativeEngine:
    """In-process engine: one target and any number of proposers (SSMs, the suffix proposer), in proposer order.

    ``cost``: the cost model of cost-aware tree shapes (``engine.shape``; ``cluster.build`` measures
    the target's verify-cost curve for it), None for the schedule's shapes. Requests run on one
    ``EngineLoop`` (``limits``: its batch and queue; a CUDA-graph target's one buffer holds one
    request at a time), except those that draft ahead (``SpeculationOptions.prefetch``), which still
    run a session of their own."""

    def __init__(self, target: Target, drafters: Sequence[object], tokenizer, eos_ids,
                 max_context: int | None = None, cost: TreeCost | None = None, limits: LoopLimits | None = None,
                 tree_budget: Callable[[int], int | None] | None = None, draft_gate: bool = True):
        self.target, self.drafters, self.tokenizer = target, list(drafters), tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.names = tuple(d.name for d in self.drafters)
        self.neural = tuple(d.neural for d in self.drafters)
        self.max_context = max_context or getattr(target.model.config, "max_position_embeddings", None)
        # drafting ahead (SpeculationOptions.prefetch): a thread per proposer, made on first use
        self.pool = ThreadPoolExecutor(max(1, len(self.drafters)), thread_name_prefix="prefetch")
        if limits is None:
            limits = LoopLimits(max_running=1) if isinstance(target, GraphedTarget) else LoopLimits()
        self.loop = local_loop(target, self.drafters, tokenizer, self.eos_ids, limits, cost, tree_budget, draft_gate)

    @property
    def cost(self) -> TreeCost | None:
        """The cost model of cost-aware tree shapes (``engine.shape``); None: schedules. The loop's."""
        return self.loop.cost

    @cost.setter
    def cost(self, cost: TreeCost | None) -> None:
        self.loop.cost = cost

    def check_request(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if self.max_context and len(request.prompt_ids) + request.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens"
            )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        token_ids, text, update = [], [], None
        for update in self.stream(request):
            token_ids.extend(update.token_ids)
            text.append(update.text)
        return GenerationResult(tuple(token_ids), "".join(text), update.finish_reason, update.stats)

    def stream(self, request: GenerationRequest) -> Iterator[StepUpdate]:
        """Yield one StepUpdate per target step; the last one carries the finish reason."""
        self.check_request(request)
        if not request.speculation.prefetch:
            yield from self.loop.stream(request)
            return
        session = Session(LocalBackend(self, request), request, self.names, self.neural, self.tokenizer,
                          self.eos_ids, cost=self.cost)
        try:
            yield from iterate_sync(session.updates())
        finally:  # also when the caller stops early (a cancel): paged KV blocks go back
            session.close()
