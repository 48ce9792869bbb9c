"""The engine loop's executor over one replica's Ray actors (``engine.loop.Executor``).

Each iteration is one call per actor: every SSM actor drafts all of its requests' trees
(``SSMActor.draft_batch``), the merge actor folds them with the suffix proposer's
(``MergeActor.merge_batch``), and the verifier runs one target pass over every tree and the chosen
prompt chunks (``VerifierActor.step_batch``). Drafts travel SSM -> merge -> verifier as object
references: the ingress never fetches a proposal, only the verifier's per-request results.

Admission counts the verifier's KV pool here (each request's worst case, as the verifier reserves
it), so a request waits in the loop's queue instead of failing. Faults: a request whose draft
failed, or every request while an SSM or the merge actor is down (``actors.liveness``), is
verified as its root alone (plain decoding, lossless) and its history is sent whole next time; a
dead verifier fails the running requests (TargetUnavailable: their KV caches are gone).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from engine.kv_pool import PoolExhausted
from engine.loop import DraftJob
from engine.requests import GenerationRequest

from .backend import MERGE, VERIFIER
from .common import TargetUnavailable
from .group import ActorGroup, ssm_role
from .liveness import Liveness
from .loop_calls import MergeJob, PrefillJob, SSMJob, TreeJob


@dataclass
class RemoteRequest:
    """A request as the executor knows it: its key in the actors, what each actor has been sent of
    its committed tokens, its root this iteration, and what its prefill needs."""

    key: str
    request: GenerationRequest
    reserve_tokens: int
    sent: dict[str, int] = field(default_factory=dict)
    root: int | None = None
    prefill_sent: bool = False


class ActorExecutor:
    """``capacity_tokens``: the verifier's pool (None: no pool, nothing to count), reserved in
    blocks of ``block_size`` tokens as the verifier's pool does."""

    def __init__(self, group: ActorGroup, liveness: Liveness, capacity_tokens: int | None, block_size: int = 1):
        self.group, self.liveness, self.capacity, self.block_size = group, liveness, capacity_tokens, block_size
        self.names, self.neural, self.windows = group.names, group.neural, group.windows
        self.requests: dict[int, RemoteRequest] = {}
        self._kv_blocks: tuple[int, int] | None = None
        self._draft_wait_ms = 0.0
        self._released: list[str] = []  # released since the last verify call: the verifier drops them first

    def admit(self, request_id: int, request: GenerationRequest, reserve_tokens: int) -> bool:
        if self.capacity is not None:
            if reserve_tokens > self.capacity:
                raise PoolExhausted(f"the request needs {reserve_tokens} tokens of KV cache (prompt + max_new_tokens "
                                    f"+ tree) but the pool holds {self.capacity} (server.batching.kv_cache_tokens)")
            if sum(map(self._blocks, [r.reserve_tokens for r in self.requests.values()] + [reserve_tokens])) \
                    > self.capacity // self.block_size:
                return False
        self.requests[request_id] = RemoteRequest(uuid.uuid4().hex, request, reserve_tokens)
        return True

    async def draft(self, jobs: list[DraftJob]):
        """The merge actor's result (an object reference) for the jobs with proposers; None when
        nobody drafts or the merge actor is down."""
        for job in jobs:
            self.requests[job.request_id].root = job.committed[-1]
        if not self.liveness.usable(MERGE) or not any(job.assignments for job in jobs):
            return None
        calls: dict[int, list[SSMJob]] = {}
        merges = [self._merge_job(job, calls) for job in jobs if job.assignments]
        order = sorted(calls)
        refs = [self.group.ssms[proposer].draft_batch.remote(calls[proposer]) for proposer in order]
        merges = [MergeJob(m.request_id, m.start, m.new_tokens, m.plan,
                           tuple((order.index(proposer), position) for proposer, position in m.places)) for m in merges]
        return self.group.merge.merge_batch.remote(merges, *refs)

    def _merge_job(self, job: DraftJob, calls: dict[int, list[SSMJob]]) -> MergeJob:
        """The job's SSM jobs appended to ``calls`` (live SSMs only); its merge job, whose places name
        (proposer, position) until the calls are ordered."""
        remote, places = self.requests[job.request_id], []
        live = tuple(a for a in job.assignments if not self.neural[a.proposer]
                     or self.liveness.usable(ssm_role(self.names[a.proposer])))
        for assignment in live:
            if self.neural[assignment.proposer]:
                start = remote.sent.get(str(assignment.proposer), 0)
                calls.setdefault(assignment.proposer, []).append(
                    SSMJob(remote.key, start, job.committed[start:], assignment))
                remote.sent[str(assignment.proposer)] = len(job.committed)
                places.append((assignment.proposer, len(calls[assignment.proposer]) - 1))
        start = remote.sent.get(MERGE, 0)
        remote.sent[MERGE] = len(job.committed)
        return MergeJob(remote.key, start, job.committed[start:], live, tuple(places))

    async def verify(self, drafted, trees: list[int], chunks: list[int]) -> dict[int, object]:
        tree_jobs = [TreeJob(self.requests[i].key, self.requests[i].root) for i in trees]
        prefills = [self._prefill_job(i) for i in chunks]
        self._draft_wait_ms = 0.0
        if not self.liveness.usable(VERIFIER):
            return self._all_failed(trees + chunks)
        began, released, self._released = time.perf_counter(), tuple(self._released), []
        try:
            reply = await self.group.verifier.step_batch.remote(drafted, tree_jobs, prefills, released)
        except RayActorError as error:
            role = self._failed_role(error)
            if role in (None, VERIFIER):
                return self._all_failed(trees + chunks)
            self._resync_all()  # a drafting actor failed: this step plain decoding for all
            reply = await self.group.verifier.step_batch.remote(None, tree_jobs, prefills, released)
        # the call's wall time beyond the verifier's own: its wait for the SSMs and the merge actor
        self._draft_wait_ms = (time.perf_counter() - began) * 1e3 - reply.call_ms
        keys = {self.requests[i].key: i for i in trees + chunks}
        for key in reply.resync:
            self.requests[keys[key]].sent.clear()
        self._kv_blocks = reply.kv_blocks
        return {keys[key]: result for key, result in reply.results.items()}

    def draft_wait_ms(self) -> float:
        return self._draft_wait_ms

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _prefill_job(self, request_id: int) -> PrefillJob:
        remote = self.requests[request_id]
        first, remote.prefill_sent = not remote.prefill_sent, True
        return PrefillJob(remote.key, remote.request.prompt_ids, remote.request.sampling, remote.reserve_tokens, first)

    def _failed_role(self, error: RayActorError) -> str | None:
        role = self.liveness.role_of(error)
        if role is not None:
            self.liveness.failed(role)
        return role

    def _all_failed(self, request_ids: list[int]) -> dict[int, object]:
        error = TargetUnavailable("the target's actor is down or restarting (its KV caches are gone); retry when "
                                  "health answers SERVING")
        return dict.fromkeys(request_ids, error)

    def _resync_all(self) -> None:
        for remote in self.requests.values():
            remote.sent.clear()

    def release(self, request_id: int) -> None:
        """Drop the request's states: everywhere by the group's detached releases, and at the verifier
        also by the next verify call, ahead of its admissions. A detached release can reach the
        verifier after the call that admits the request the freed blocks were counted for (``admit``
        counts them free at once): that request then failed with RESOURCE_EXHAUSTED instead of
        running (tests/test_served_loop.py, a pool that holds one of two requests)."""
        remote = self.requests.pop(request_id, None)
        if remote is not None:
            self._released.append(remote.key)
            self.group.release(remote.key)

    def kv_blocks(self) -> tuple[int, int] | None:
        return self._kv_blocks
