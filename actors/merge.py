"""The merge actor: folds the SSMs' proposals (and the free n-gram proposal) into one tree."""

from __future__ import annotations

from settings.config import NgramConfig
from engine.draft import DraftSpec, NgramDrafter, Proposal
from engine.generate import root_only_proposal
from engine.merge import merge

from .common import setup_process


class MergeActor:
    """Stateless: every call carries what it needs. The n-gram proposer is ``ngram_index``."""

    def __init__(self, ngram: NgramConfig | None, ngram_index: int, torch_threads: int):
        setup_process(torch_threads)
        self.ngram = None
        if ngram is not None:
            self.ngram = NgramDrafter(ngram_index, ngram.name, ngram.max_ngram, ngram.min_ngram, ngram.max_tokens,
                                      ngram.max_matches)

    def ready(self) -> str | None:
        return self.ngram.name if self.ngram else None

    def merge(self, committed: list[int], ngram_spec: DraftSpec | None, *proposals: Proposal | None) -> Proposal | None:
        """Merge the SSM proposals in proposer order, the n-gram one (if asked for) last.

        None when an SSM returned None (the request was released meanwhile).
        """
        if any(p is None for p in proposals):
            return None
        chosen = list(proposals)
        if ngram_spec is not None:
            chosen.append(self.ngram.draft(None, committed, ngram_spec, None))
        return merge(chosen) if chosen else root_only_proposal(committed[-1])

    def num_requests(self) -> int:
        return 0
