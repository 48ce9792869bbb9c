"""The merge actor: folds the SSMs' drafts (and the suffix proposer's) into one tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from engine.loop import DraftJob
from engine.phases import DraftSide, merge_job
from engine.step import Assignment, Drafted, merge_drafts
from settings.config import SuffixConfig

from .common import HoldsRequests, NeedsResync, setup_process, sweep_interval, sync_history
from .loop_calls import MergeJob
from .store import RequestStore, start_sweeper
from .suffix import SuffixDrafter, SuffixState


@dataclass
class MergeState:
    """One request's committed tokens and its state in the suffix proposer (None without one)."""

    suffix: SuffixState | None
    history: list[int] = field(default_factory=list)


class MergeActor(HoldsRequests):
    """Keeps each request's committed tokens and runs the suffix proposer (proposer ``suffix_index``).

    The suffix proposer's global store belongs to this actor: one per served replica. A request's
    suffix state is released with the request (release or TTL expiry).
    """

    def __init__(self, suffix: SuffixConfig | None, suffix_index: int, torch_threads: int, request_ttl_s: float):
        setup_process(torch_threads)
        self.suffix_index = suffix_index
        self.suffix = SuffixDrafter(suffix_index, suffix) if suffix is not None else None
        self.store: RequestStore[MergeState] = RequestStore(request_ttl_s, on_drop=self._drop)
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(request_ttl_s))
        # the engine loop's calls (merge_batch)
        self.init_loop(DraftSide({suffix_index: self.suffix} if self.suffix is not None else {}))

    def ready(self) -> str | None:
        return self.suffix.name if self.suffix else None

    def merge_batch(self, jobs: list[MergeJob], *ssm_results: list) -> dict[str, Drafted | BaseException]:
        """The engine loop's merge phase: per job, the SSMs' drafts (``MergeJob.places`` in
        ``ssm_results``, one list per SSM call) and the suffix proposer's, merged in proposer order;
        or the job's first error (NeedsResync where a history lacks its start)."""
        merged, ready = {}, []
        with self.loop_lock:
            for job in jobs:
                try:
                    ready.append(DraftJob(job.request_id, self.loop_history(job.request_id, job.start, job.new_tokens),
                                          job.plan))
                except NeedsResync as error:
                    merged[job.request_id] = error
            suffix = self.loop_side.draft(ready)
        places = {job.request_id: job.places for job in jobs}
        for job in ready:
            drafts = dict(suffix[job.request_id])
            neural = [a for a in job.assignments if a.proposer not in drafts]
            for assignment, (call, position) in zip(neural, places[job.request_id], strict=True):
                drafts[assignment.proposer] = ssm_results[call][position]
            slowest = max((d.draft_ms for d in drafts.values() if isinstance(d, Drafted)), default=0.0)
            merged[job.request_id] = merge_job(job, drafts, slowest)
        return merged

    def merge(self, request_id: str, start: int, new_tokens: list[int], plan: Sequence[Assignment],
              *ssm_drafts: Drafted | None) -> Drafted | None:
        """Merge in plan (proposer) order: the SSM drafts fill the neural places, the suffix its own.

        ``new_tokens`` from offset ``start`` as for the SSM actors. None when an SSM returned None
        or the request was released (its state is gone).
        """
        state = self.store.get_or_create(request_id, self._new_state)
        if state is None or any(d is None for d in ssm_drafts):
            return None
        history = state.history
        sync_history(history, start, new_tokens)
        drafts, pending = [], iter(ssm_drafts)
        for assignment in plan:
            if assignment.proposer == self.suffix_index and self.suffix is not None:
                drafts.append(Drafted(self.suffix.draft(state.suffix, history, assignment.spec)))
            else:
                drafts.append(next(pending))
        slowest = max((d.draft_ms for d in ssm_drafts), default=0.0)  # the SSMs drafted in parallel
        return merge_drafts(drafts, history[-1], slowest)

    def _new_state(self) -> MergeState:
        return MergeState(self.suffix.new_state() if self.suffix else None)

    def _drop(self, state: MergeState) -> None:
        if self.suffix is not None and state.suffix is not None:
            self.suffix.release(state.suffix)
