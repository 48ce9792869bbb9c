"""A request's model calls sent to the actors: ``engine.step.Backend`` over an ``ActorGroup``.

All SSM actors of a step are called at once, so a step waits for the slowest SSM, not their sum.
Drafts travel SSM -> merge actor -> verifier as object references: the caller never fetches a
proposal, it gets the verifier's ``StepOutcome`` back. With ``prefetch`` each SSM drafts the next
tree ahead while the merge actor and the verifier work (``actors.ssm``, ``engine.prefetch``). SSMs and the merge actor receive only the
tokens committed since their last call; one that lacks the request's history answers
NeedsResync and the step is sent again with the whole history.

Faults (``actors.liveness``): when a step fails because an SSM or the merge actor died, that
actor is marked down and the step is sent again without it: the proposer is left out of the
merge, or, without a merge actor, the verifier gets the root-only tree (plain decoding). Either
is lossless: verification is exact for any proposal. Once a probe finds the actor alive again it
is used again, resynced with the whole history. A dead or restarting verifier fails the request
at once (TargetUnavailable, UNAVAILABLE): its KV caches are gone with it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

from ray.exceptions import RayActorError

from engine.kv_pool import PoolExhausted
from engine.requests import StepOutcome
from engine.sampling import SamplingParams
from engine.step import Assignment, Drafted, root_only_proposal

from .common import NeedsResync, TargetUnavailable
from .group import ActorGroup, ssm_role
from .liveness import Liveness

VERIFIER, MERGE = "verifier", "merge"


@dataclass(frozen=True)
class Admission:
    """KV memory a request reserves in the verifier's pool, and how long it may wait for it."""

    reserve_tokens: int = 0
    timeout_s: float = 0.0


class ActorBackend:
    def __init__(self, group: ActorGroup, request_id: str, sampling: SamplingParams, liveness: Liveness,
                 admission: Admission = Admission(), prefetch: int = 0):
        self.group, self.request_id, self.sampling, self.admission = group, request_id, sampling, admission
        self.prefetch = prefetch  # outcomes each SSM drafts ahead for during verification (engine.prefetch)
        self.liveness = liveness
        self.sent = 0  # committed tokens the SSM and merge actors have been sent
        self._drafting: frozenset[int] = frozenset()  # the proposers of the last step sent
        self._last_draft: tuple[list[int], Sequence[Assignment]] | None = None

    async def prefill(self, prompt_ids: list[int]) -> int | None:
        """Prefill, retried while the verifier's KV pool cannot promise this request's blocks."""
        deadline = time.monotonic() + self.admission.timeout_s
        while True:
            self._check_target()
            try:
                return await self.group.verifier.prefill.remote(self.request_id, prompt_ids, self.sampling,
                                                                self.admission.reserve_tokens)
            except PoolExhausted:
                if time.monotonic() >= deadline:
                    raise PoolExhausted(f"no KV memory for {self.admission.reserve_tokens} tokens within "
                                        f"{self.admission.timeout_s:g} s (server.batching.admission_timeout_s); "
                                        "retry later") from None
                await asyncio.sleep(0.05)
            except RayActorError as error:
                self._actor_failed(error)
                raise

    async def draft(self, committed: list[int], plan: Sequence[Assignment]):
        """The merged draft as an object reference (resolved in the verifier, not here)."""
        self._last_draft = (committed, plan)
        return self._send(committed, plan)

    async def verify(self, drafted) -> StepOutcome | None:
        """Verify; a step that failed for a lost history or a dead SSM / merge actor is sent again."""
        for _ in range(len(self.group.everyone()) + 1):  # each retry has lost history or one more actor
            self._check_target()
            try:
                return await self.group.verifier.verify.remote(self.request_id, drafted)
            except NeedsResync:  # an SSM or the merge actor lost the request's history: send it all
                if self._last_draft is None or isinstance(drafted, Drafted):
                    raise
            except RayActorError as error:
                if self._actor_failed(error) in (None, VERIFIER) or self._last_draft is None:
                    raise
            self.sent = 0
            drafted = self._send(*self._last_draft)
        raise RuntimeError(f"request {self.request_id}: the step failed on every retry")

    def release(self) -> None:
        self.group.release(self.request_id)

    def _send(self, committed: list[int], plan: Sequence[Assignment]):
        """This step's drafts from the live proposers, merged by the merge actor (a reference); the
        root-only tree while the merge actor is down."""
        if not self.liveness.usable(MERGE):
            self.sent, self._drafting = 0, frozenset()  # the merge actor misses these tokens
            return Drafted(root_only_proposal(committed[-1]))
        live = [a for a in plan if not self.group.neural[a.proposer]
                or self.liveness.usable(ssm_role(self.group.names[a.proposer]))]
        drafting = frozenset(a.proposer for a in live)
        if drafting - self._drafting:  # a proposer left out of earlier steps lacks their tokens
            self.sent = 0
        self._drafting = drafting
        start, self.sent = self.sent, len(committed)
        new = committed[start:]
        drafts = [self.group.ssms[a.proposer].draft.remote(self.request_id, start, new, a, self.prefetch)
                  for a in live if self.group.neural[a.proposer]]
        return self.group.merge.merge.remote(self.request_id, start, new, live, *drafts)

    def _check_target(self) -> None:
        if not self.liveness.usable(VERIFIER):
            raise TargetUnavailable("the target's actor is down or restarting (its KV caches are gone); "
                                    "retry when health answers SERVING")

    def _actor_failed(self, error: RayActorError) -> str | None:
        """Mark the actor the error names down; its role (None: not one of this group's)."""
        role = self.liveness.role_of(error)
        if role is not None:
            self.liveness.failed(role)
        return role
