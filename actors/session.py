"""One request driven over the actors: prefill, then draft -> merge -> verify -> commit per step.

The same steps as ``engine.generate._Session``, with each model call sent to its actor. All SSM
actors of a step are called at once, so a step waits for the slowest SSM, not their sum; the
proposals travel SSM -> merge actor -> verifier as object references.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from engine.draft import Proposal
from engine.generate import (GenerationRequest, GenerationStats, StepUpdate, advance, plan_proposers,
                             record_step, root_only_proposal)
from engine.paged import PoolExhausted
from engine.text import TextStream

from .group import ActorGroup

CANCELLED = "cancelled"  # finish reason when an actor dropped the request (released or expired)


@dataclass(frozen=True)
class Admission:
    """KV memory a request reserves in the verifier's pool, and how long it may wait for it."""

    reserve_tokens: int = 0
    timeout_s: float = 0.0


class RemoteSession:
    """``tree_budget()``: the most nodes this request's tree may have this step (None: no cap)."""

    def __init__(self, group: ActorGroup, request: GenerationRequest, tokenizer, eos_ids, request_id: str,
                 admission: Admission = Admission(), tree_budget: Callable[[], int | None] = lambda: None):
        self.group, self.request, self.request_id = group, request, request_id
        self.eos_ids = frozenset(eos_ids)
        self.admission, self.tree_budget = admission, tree_budget
        self._plan(request.speculation.max_tree_nodes)
        self.stats = GenerationStats(mode=request.speculation.mode)
        self.committed = list(request.prompt_ids)
        self.text = TextStream(tokenizer, request.stop)
        self.started = time.perf_counter()

    async def updates(self) -> AsyncIterator[StepUpdate]:
        """One update per target step; the last one has a finish reason. The caller releases."""
        update = await self._prefill()
        yield update
        while update.finish_reason is None:
            update = await self._step()
            yield update

    def release(self) -> None:
        self.group.release(self.request_id)

    def _plan(self, max_tree_nodes: int) -> None:
        """The proposers' draft specs for trees of at most ``max_tree_nodes`` (kept until it changes)."""
        self.planned_nodes = max_tree_nodes
        options = replace(self.request.speculation, max_tree_nodes=max_tree_nodes)
        plan = plan_proposers(self.group.names, self.group.neural, options)
        specs = [(i, replace(spec, sampling=self.request.sampling)) for i, spec in plan]
        self.ssm_specs = [(i, spec) for i, spec in specs if self.group.neural[i]]
        self.ngram_spec = next((spec for i, spec in specs if not self.group.neural[i]), None)

    async def _prefill(self) -> StepUpdate:
        first = await self._admit()
        if first is None:
            return self._cancelled()
        self.stats.target_steps = 1
        return self._emit([first])

    async def _admit(self) -> int | None:
        """Prefill, retried while the verifier's KV pool cannot promise this request's blocks."""
        deadline = time.monotonic() + self.admission.timeout_s
        while True:
            try:
                return await self.group.verifier.prefill.remote(self.request_id, self.committed,
                                                                self.request.sampling, self.admission.reserve_tokens)
            except PoolExhausted:
                if time.monotonic() >= deadline:
                    raise PoolExhausted(f"no KV memory for {self.admission.reserve_tokens} tokens within "
                                        f"{self.admission.timeout_s:g} s (server.batching.admission_timeout_s); "
                                        "retry later") from None
                await asyncio.sleep(0.05)

    async def _step(self) -> StepUpdate:
        budget, nodes = self.tree_budget(), self.request.speculation.max_tree_nodes
        nodes = nodes if budget is None else min(budget, nodes)
        if nodes != self.planned_nodes:
            self._plan(nodes)
        began = time.perf_counter()
        proposal_ref = self._draft()
        proposal: Proposal | None = await proposal_ref if not isinstance(proposal_ref, Proposal) else proposal_ref
        if proposal is None:
            return self._cancelled()
        drafted = time.perf_counter()
        verdict = await self.group.verifier.verify.remote(self.request_id, proposal_ref)
        if verdict is None:
            return self._cancelled()
        tokens = record_step(self.stats, proposal, verdict, self.group.names, (drafted - began) * 1e3,
                             (time.perf_counter() - drafted) * 1e3)
        return self._emit(tokens)

    def _draft(self):
        """The merged proposal as an object reference (or, without proposers, the root alone)."""
        if not self.ssm_specs and self.ngram_spec is None:
            return root_only_proposal(self.committed[-1])
        seed = self.request.sampling.seed
        drafts = [self.group.ssms[i].draft.remote(self.request_id, self.committed, spec, seed)
                  for i, spec in self.ssm_specs]
        return self.group.merge.merge.remote(self.committed, self.ngram_spec, *drafts)

    def _emit(self, new: list[int]) -> StepUpdate:
        kept, chunk, reason = advance(self.text, self.stats, new, self.request.max_new_tokens, self.eos_ids)
        self.committed.extend(kept)
        self.stats.total_ms = (time.perf_counter() - self.started) * 1e3
        return StepUpdate(tuple(kept), chunk, reason, self.stats)

    def _cancelled(self) -> StepUpdate:
        self.stats.total_ms = (time.perf_counter() - self.started) * 1e3
        return StepUpdate((), self.text.finish(), CANCELLED, self.stats)
