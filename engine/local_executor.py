"""The engine loop's executor over models in this process (``engine.loop.Executor``).

Each request's states (the target's, each proposer's, its target generator, its prefill under way)
live here. Drafting runs every request's draft program together (``engine.programs.run_rounds``:
one packed forward per SSM per tree level for the whole batch; the model-free proposers beside
them), then merges per request; verification runs one round over every tree's verify program and
each chosen prompt's next chunk (one packed target pass). Its async methods never suspend, so the
loop's ``step`` drives them without an event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .draft import ModelDrafter
from .kv_pool import PoolExhausted
from .loop import DraftJob, EngineLoop, LoopLimits
from .paged_models import PagedTarget
from .programs import Running, run_round, run_rounds, start
from .requests import GenerationRequest
from .sampling import SamplingParams, make_generator
from .shape import TreeCost
from .step import TARGET_STREAM, Drafted, draft_with, first_token, merge_drafts, root_only_proposal, verify_program
from .target import Target


@dataclass
class LocalState:
    """One request's states here: the target's, each proposer's (made on first use), its target
    generator and sampling, and its prefill program while the prompt is being fed."""

    target: object
    sampling: SamplingParams
    generator: torch.Generator
    prefill: Running | None = None
    proposers: dict[int, object] = field(default_factory=dict)


class LocalExecutor:
    """``target`` and ``drafters`` (in proposer order) in this process; prompts fed in chunks of
    ``chunk_tokens`` (None: whole) where the target packs its forwards."""

    def __init__(self, target: Target, drafters: Sequence[object], chunk_tokens: int | None = None):
        self.target, self.drafters, self.chunk_tokens = target, list(drafters), chunk_tokens
        self.names = tuple(d.name for d in self.drafters)
        self.neural = tuple(isinstance(d, ModelDrafter) for d in self.drafters)
        self.states: dict[int, LocalState] = {}

    def admit(self, request_id: int, request: GenerationRequest, reserve_tokens: int) -> bool:
        try:
            target_state = self.target.new_state(reserve_tokens)
        except PoolExhausted:
            return False
        state = LocalState(target_state, request.sampling, make_generator(request.sampling.seed, TARGET_STREAM))
        self.states[request_id] = state
        state.prefill = start(self.target.prefill_program(target_state, list(request.prompt_ids), self.chunk_tokens))
        if state.prefill.error is not None:  # before any forward: the prompt itself
            self.release(request_id)
            raise state.prefill.error
        return True

    async def draft(self, jobs: list[DraftJob]) -> dict[int, Drafted | BaseException]:
        """Each job's merged tree (or its error): the neural drafters' programs in rounds together."""
        began, drafts, programs = time.perf_counter(), {job.request_id: {} for job in jobs}, []
        with torch.inference_mode():
            for job in jobs:
                for assignment in job.assignments:
                    drafter, committed = self.drafters[assignment.proposer], list(job.committed)
                    state, generator = self._proposer_state(job.request_id, assignment.proposer), \
                        assignment.generator(len(committed))
                    if self.neural[assignment.proposer]:
                        program = drafter.draft_program(state, committed, assignment.spec, generator)
                        programs.append((job.request_id, assignment.proposer, start(program)))
                    else:
                        drafts[job.request_id][assignment.proposer] = draft_with(drafter, state, committed,
                                                                                assignment.spec, generator)
            run_rounds([running for _, _, running in programs])
        for request_id, proposer, running in programs:
            drafts[request_id][proposer] = running.error if running.error is not None else Drafted(running.result)
        draft_ms = (time.perf_counter() - began) * 1e3
        return {job.request_id: self._merge(job, drafts[job.request_id], draft_ms) for job in jobs}

    def _merge(self, job: DraftJob, drafts: dict[int, Drafted | BaseException], draft_ms: float):
        errors = [d for d in drafts.values() if isinstance(d, BaseException)]
        if errors:
            return errors[0]
        if not drafts:
            return Drafted(root_only_proposal(job.committed[-1]), draft_ms)
        return merge_drafts([drafts[p] for p in sorted(drafts)], job.committed[-1], draft_ms)

    async def verify(self, drafted: dict[int, Drafted | BaseException], trees: list[int],
                     chunks: list[int]) -> dict[int, object]:
        """One round: every tree's verify program and each chunk's prefill program."""
        programs: dict[int, Running] = {}
        with torch.inference_mode():
            for request_id in trees:
                tree, state = drafted[request_id], self.states[request_id]
                if isinstance(tree, BaseException):
                    continue
                programs[request_id] = start(verify_program(self.target, state.target, tree, state.sampling,
                                                            state.generator))
            programs.update({request_id: self.states[request_id].prefill for request_id in chunks})
            run_round(list(programs.values()))
        results = {request_id: drafted[request_id] for request_id in trees if request_id not in programs}
        for request_id, running in programs.items():
            results[request_id] = self._result(request_id, running)
        return results

    def _result(self, request_id: int, running: Running):
        """A program's result for the loop: its error, a verify outcome, or a prefill's first token
        (None while chunks are left)."""
        if running.error is not None:
            return running.error
        state = self.states[request_id]
        if running is not state.prefill:
            return running.result
        if not running.done:
            return None
        state.prefill = None
        return first_token(running.result, state.sampling, state.generator)

    def release(self, request_id: int) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        if state.prefill is not None and not state.prefill.done:
            state.prefill.program.close()
        self.target.release(state.target)
        for proposer, proposer_state in state.proposers.items():
            self.drafters[proposer].release(proposer_state)

    def kv_blocks(self) -> tuple[int, int] | None:
        if not isinstance(self.target, PagedTarget):
            return None
        pool = self.target.pool
        return pool.num_blocks - pool.num_free, pool.num_blocks

    def _proposer_state(self, request_id: int, proposer: int):
        states = self.states[request_id].proposers
        if proposer not in states:
            states[proposer] = self.drafters[proposer].new_state()
        return states[proposer]


def local_loop(target: Target, drafters: Sequence[object], tokenizer, eos_ids, limits: LoopLimits = LoopLimits(),
               cost: TreeCost | None = None, tree_budget: Callable[[int], int | None] | None = None) -> EngineLoop:
    """An engine loop over ``target`` and ``drafters`` in this process."""
    return EngineLoop(LocalExecutor(target, drafters, limits.chunk_tokens), tokenizer, eos_ids, limits, cost,
                      tree_budget)
