"""The merge actor: folds the SSMs' drafts (and the free n-gram proposal) into one tree."""

from __future__ import annotations

from typing import Sequence

from engine.draft import NgramDrafter
from engine.step import Assignment, Drafted, merge_drafts
from settings.config import NgramConfig

from .common import HoldsRequests, setup_process, sweep_interval, sync_history
from .store import RequestStore, start_sweeper


class MergeActor(HoldsRequests):
    """Keeps each request's committed tokens (for the n-gram proposer, proposer ``ngram_index``)."""

    def __init__(self, ngram: NgramConfig | None, ngram_index: int, torch_threads: int, request_ttl_s: float):
        setup_process(torch_threads)
        self.ngram, self.ngram_index = None, ngram_index
        if ngram is not None:
            self.ngram = NgramDrafter(ngram_index, ngram.name, ngram.max_ngram, ngram.min_ngram, ngram.max_tokens,
                                      ngram.max_matches)
        self.store: RequestStore[list[int]] = RequestStore(request_ttl_s)
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(request_ttl_s))

    def ready(self) -> str | None:
        return self.ngram.name if self.ngram else None

    def merge(self, request_id: str, start: int, new_tokens: list[int], plan: Sequence[Assignment],
              *ssm_drafts: Drafted | None) -> Drafted | None:
        """Merge in plan (proposer) order: the SSM drafts fill the neural places, the n-gram its own.

        ``new_tokens`` from offset ``start`` as for the SSM actors. None when an SSM returned None
        or the request was released (its state is gone).
        """
        history = self.store.get_or_create(request_id, list)
        if history is None or any(d is None for d in ssm_drafts):
            return None
        sync_history(history, start, new_tokens)
        drafts, pending = [], iter(ssm_drafts)
        for assignment in plan:
            if assignment.proposer == self.ngram_index and self.ngram is not None:
                drafts.append(Drafted(self.ngram.draft(None, history, assignment.spec, None)))
            else:
                drafts.append(next(pending))
        slowest = max((d.draft_ms for d in ssm_drafts), default=0.0)  # the SSMs drafted in parallel
        return merge_drafts(drafts, history[-1], slowest)
