"""A request's model calls sent to the actors: ``engine.step.Backend`` over an ``ActorGroup``.

All SSM actors of a step are called at once, so a step waits for the slowest SSM, not their sum.
Drafts travel SSM -> merge actor -> verifier as object references: the caller never fetches a
proposal, it gets the verifier's ``StepOutcome`` back. SSMs and the merge actor receive only the
tokens committed since their last call; one that lacks the request's history answers
NeedsResync and the step is sent again with the whole history.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

from engine.kv_pool import PoolExhausted
from engine.requests import StepOutcome
from engine.sampling import SamplingParams
from engine.step import Assignment, Drafted

from .common import NeedsResync
from .group import ActorGroup


@dataclass(frozen=True)
class Admission:
    """KV memory a request reserves in the verifier's pool, and how long it may wait for it."""

    reserve_tokens: int = 0
    timeout_s: float = 0.0


class ActorBackend:
    def __init__(self, group: ActorGroup, request_id: str, sampling: SamplingParams,
                 admission: Admission = Admission()):
        self.group, self.request_id, self.sampling, self.admission = group, request_id, sampling, admission
        self.sent = 0  # committed tokens the SSM and merge actors have been sent
        self._last_draft: tuple[list[int], Sequence[Assignment]] | None = None

    async def prefill(self, prompt_ids: list[int]) -> int | None:
        """Prefill, retried while the verifier's KV pool cannot promise this request's blocks."""
        deadline = time.monotonic() + self.admission.timeout_s
        while True:
            try:
                return await self.group.verifier.prefill.remote(self.request_id, prompt_ids, self.sampling,
                                                                self.admission.reserve_tokens)
            except PoolExhausted:
                if time.monotonic() >= deadline:
                    raise PoolExhausted(f"no KV memory for {self.admission.reserve_tokens} tokens within "
                                        f"{self.admission.timeout_s:g} s (server.batching.admission_timeout_s); "
                                        "retry later") from None
                await asyncio.sleep(0.05)

    async def draft(self, committed: list[int], plan: Sequence[Assignment]):
        """The merged draft as an object reference (resolved in the verifier, not here)."""
        self._last_draft = (committed, plan)
        start, self.sent = self.sent, len(committed)
        new = committed[start:]
        drafts = [self.group.ssms[a.proposer].draft.remote(self.request_id, start, new, a)
                  for a in plan if self.group.neural[a.proposer]]
        return self.group.merge.merge.remote(self.request_id, start, new, plan, *drafts)

    async def verify(self, drafted) -> StepOutcome | None:
        try:
            return await self.group.verifier.verify.remote(self.request_id, drafted)
        except NeedsResync:  # an SSM or the merge actor lost the request's history: send it all
            if self._last_draft is None or isinstance(drafted, Drafted):
                raise
            self.sent = 0
            return await self.group.verifier.verify.remote(self.request_id, await self.draft(*self._last_draft))

    def release(self) -> None:
        self.group.release(self.request_id)
