"""The engine loop's phases over models in one process.

``TargetSide`` holds requests' target states and runs the verify phase: one round over every tree's
verify program and each chosen prompt's next chunk (one packed target pass). ``DraftSide`` holds
requests' proposer states and runs the draft phase: every job's draft programs in rounds together
(``engine.programs.run_rounds``: one packed forward per SSM per tree level for the whole batch),
the model-free proposers beside them. ``LocalExecutor`` (``engine.loop.Executor``) puts both in
this process, merging per request between them; the served actors run the same sides, each its
own part. The executor's async methods never suspend, so the loop's ``step`` drives them without
an event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .draft import ModelDrafter
from .kv_pool import PoolExhausted, StateLost
from .loop import DraftJob, EngineLoop, LoopLimits
from .paged_models import PagedTarget
from .programs import Running, run_round, run_rounds, start
from .requests import GenerationRequest
from .sampling import SamplingParams, make_generator
from .shape import TreeCost
from .step import TARGET_STREAM, Drafted, draft_with, first_token, merge_drafts, root_only_proposal, verify_program
from .target import Target


@dataclass
class TargetState:
    """One request's target side: its state on the target, sampling and generator, and its prefill
    program while the prompt is being fed."""

    target: object
    sampling: SamplingParams
    generator: torch.Generator
    prefill: Running | None = None


class TargetSide:
    """Requests' target states (keyed by any id) and the verify phase: one round over every tree's
    verify program and each chosen prompt's next chunk (one packed target pass). The served
    verifier actor runs the same code."""

    def __init__(self, target: Target, chunk_tokens: int | None = None):
        self.target, self.chunk_tokens = target, chunk_tokens
        self.states: dict = {}

    def admit(self, request_id, prompt_ids: Sequence[int], sampling: SamplingParams, reserve_tokens: int) -> bool:
        """The request's state with ``reserve_tokens`` reserved, its prefill started; False when the
        pool cannot promise them; the prompt's own error raised."""
        try:
            target_state = self.target.new_state(reserve_tokens)
        except PoolExhausted:
            return False
        state = TargetState(target_state, sampling, make_generator(sampling.seed, TARGET_STREAM))
        self.states[request_id] = state
        state.prefill = start(self.target.prefill_program(target_state, list(prompt_ids), self.chunk_tokens))
        if state.prefill.error is not None:  # before any forward: the prompt itself
            self.release(request_id)
            raise state.prefill.error
        return True

    def verify(self, trees: dict, chunks: Sequence) -> dict:
        """``trees``: request -> its merged Drafted (or the error that ends it); ``chunks``: requests
        whose next prompt chunk joins the pass. Per request: a StepOutcome, a first token (int), None
        (chunks left) or an exception."""
        programs: dict = {}
        with torch.inference_mode():
            for request_id, tree in trees.items():
                state = self.states.get(request_id)
                if isinstance(tree, BaseException) or state is None:
                    continue
                programs[request_id] = start(verify_program(self.target, state.target, tree, state.sampling,
                                                            state.generator))
            programs.update({request_id: self.states[request_id].prefill for request_id in chunks
                             if request_id in self.states})
            run_round(list(programs.values()))
        results = {request_id: tree if isinstance(tree, BaseException) else StateLost(f"no target state for {request_id}")
                   for request_id, tree in trees.items() if request_id not in programs}
        results.update({request_id: StateLost(f"no target state for {request_id}") for request_id in chunks
                        if request_id not in programs})
        for request_id, running in programs.items():
            results[request_id] = self._result(request_id, running)
        return results

    def _result(self, request_id, running: Running):
        """A program's result: its error, a verify outcome, or a prefill's first token (None while
        chunks are left)."""
        if running.error is not None:
            return running.error
        state = self.states[request_id]
        if running is not state.prefill:
            return running.result
        if not running.done:
            return None
        state.prefill = None
        return first_token(running.result, state.sampling, state.generator)

    def release(self, request_id) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        if state.prefill is not None and not state.prefill.done:
            state.prefill.program.close()
        self.target.release(state.target)

    def kv_blocks(self) -> tuple[int, int] | None:
        if not isinstance(self.target, PagedTarget):
            return None
        pool = self.target.pool
        return pool.num_blocks - pool.num_free, pool.num_blocks


class DraftSide:
    """Requests' proposer states (keyed by any id) and the draft phase: every job's neural drafts as
    programs in rounds together (one packed forward per SSM per tree level), the model-free ones
    beside them. ``drafters``: proposer index -> drafter (a served SSM actor holds one).

    An SSM that starts drafting for a request first feeds it the context it lacks (0.9 ms a token
    for the default int8 SSM). A drafter with ``context_tokens`` (``ssms[].context_tokens``) reads
    the request as if it began that many tokens before its first draft (its positions from 0) and
    keeps every token after. Drafts are proposals, so output stays the target's own; only how often
    they are accepted can move.
    """

    def __init__(self, drafters: dict[int, object]):
        self.drafters = drafters
        self.states: dict = {}
        self.starts: dict = {}  # (request, proposer) -> the first committed token its SSM holds

    def draft(self, jobs: Sequence[DraftJob]) -> dict:
        """Per job: proposer -> its Drafted or error, for the job's assignments this side holds."""
        drafts, programs = {job.request_id: {} for job in jobs}, []
        with torch.inference_mode():
            for job in jobs:
                for assignment in job.assignments:
                    drafter = self.drafters.get(assignment.proposer)
                    if drafter is None:
                        continue
                    state, generator = self._state(job.request_id, assignment.proposer), assignment.generator(
                        len(job.committed))
                    if isinstance(drafter, ModelDrafter):
                        seen = list(job.committed[self._start(job.request_id, drafter, len(job.committed)):])
                        program = drafter.draft_program(state, seen, assignment.spec, generator)
                        programs.append((job.request_id, assignment.proposer, start(program)))
                    else:
                        drafts[job.request_id][assignment.proposer] = draft_with(drafter, state, list(job.committed),
                                                                                assignment.spec, generator)
            run_rounds([running for _, _, running in programs])
        for request_id, proposer, running in programs:
            drafts[request_id][proposer] = running.error if running.error is not None else Drafted(running.result)
        return drafts

    def release(self, request_id) -> None:
        for proposer, state in self.states.pop(request_id, {}).items():
            self.starts.pop((request_id, proposer), None)
            self.drafters[proposer].release(state)

    def _start(self, request_id, drafter: ModelDrafter, committed: int) -> int:
        """Where the drafter's view of the request begins: fixed at its first draft, ``context_tokens``
        before the end of the ``committed`` tokens then (0 without a window).

        Example: a window of 64, a 200-token prompt and its first token (201 committed) -> 137: the SSM
        takes in 64 tokens; 30 tokens later it sees committed[137:231], 94 tokens."""
        key = (request_id, drafter.proposer)
        if key not in self.starts:
            window = drafter.context_tokens
            self.starts[key] = max(0, committed - window) if window else 0
        return self.starts[key]

    def _state(self, request_id, proposer: int):
        states = self.states.setdefault(request_id, {})
        if proposer not in states:
            states[proposer] = self.drafters[proposer].new_state()
        return states[proposer]


def merge_job(job: DraftJob, drafts: dict[int, Drafted | BaseException], draft_ms: float) -> Drafted | BaseException:
    """A job's drafts (proposer -> Drafted) merged in proposer order; the first error instead, if any;
    the root alone when nobody drafted."""
    errors = [d for d in drafts.values() if isinstance(d, BaseException)]
    if errors:
        return errors[0]
    if not drafts:
        return Drafted(root_only_proposal(job.committed[-1]), draft_ms)
    return merge_drafts([drafts[p] for p in sorted(drafts)], job.committed[-1], draft_ms)


class LocalExecutor:
    """``target`` and ``drafters`` (in proposer order) in this process; prompts fed in chunks of
    ``chunk_tokens`` (None: whole) where the target packs its forwards."""

    def __init__(self, target: Target, drafters: Sequence[object], chunk_tokens: int | None = None):
        self.target, self.drafters = target, list(drafters)
        self.names = tuple(d.name for d in self.drafters)
        self.neural = tuple(d.neural for d in self.drafters)
        self.windows = tuple(d.context_tokens if isinstance(d, ModelDrafter) else None for d in self.drafters)
        self.target_side, self.draft_side = TargetSide(target, chunk_tokens), DraftSide(dict(enumerate(self.drafters)))

    def admit(self, request_id: int, request: GenerationRequest, reserve_tokens: int) -> bool:
        return self.target_side.admit(request_id, request.prompt_ids, request.sampling, reserve_tokens)

    async def draft(self, jobs: list[DraftJob]) -> dict[int, Drafted | BaseException]:
        """Each job's merged tree (or its error)."""
        began = time.perf_counter()
        drafts = self.draft_side.draft(jobs)
        draft_ms = (time.perf_counter() - began) * 1e3
        return {job.request_id: merge_job(job, drafts[job.request_id], draft_ms) for job in jobs}

    async def verify(self, drafted: dict[int, Drafted | BaseException], trees: list[int],
                     chunks: list[int]) -> dict[int, object]:
        return self.target_side.verify({request_id: drafted[request_id] for request_id in trees}, chunks)

    def draft_wait_ms(self) -> float:
        return 0.0  # ``draft`` ran the drafters

    def release(self, request_id: int) -> None:
        self.target_side.release(request_id)
        self.draft_side.release(request_id)

    def kv_blocks(self) -> tuple[int, int] | None:
        return self.target_side.kv_blocks()


def local_loop(target: Target, drafters: Sequence[object], tokenizer, eos_ids, limits: LoopLimits = LoopLimits(),
               cost: TreeCost | None = None, tree_budget: Callable[[int], int | None] | None = None,
               draft_gate: bool = True) -> EngineLoop:
    """An engine loop over ``target`` and ``drafters`` in this process."""
    return EngineLoop(LocalExecutor(target, drafters, limits.chunk_tokens), tokenizer, eos_ids, limits, cost,
                      tree_budget, draft_gate)
