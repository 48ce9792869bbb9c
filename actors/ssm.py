"""One neural SSM per actor: the model plus each request's draft cache.

Prefetch (``engine.prefetch``): after drafting a request's tree, the actor drafts ahead on a thread
of its own while the merge actor and the verifier work, for the outcomes it guesses; the request's
next draft call takes a prepared tree that matches the verdict, or drafts as usual.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from settings.config import EngineConfig
from engine.paged_models import SSM_POOL_SCALE, PagedDrafter
from engine.cross_vocab import CrossState, CrossVocabDrafter, TranslationCounts
from engine.draft import ModelDrafter
from engine.models import LoadedModel, load_header
from engine.kv_pool import PagedSequence
from engine.prefetch import Ahead
from engine.loop import DraftJob
from engine.phases import DraftSide
from engine.step import Assignment, Drafted

from .guard import Guard, make_dropper
from .targets import batching_parts
from .common import (ComputeThread, HoldsRequests, NeedsResync, Vocabulary, on_compute_thread, setup_process,
                     sweep_interval, sync_history, vocabulary)
from .loop_calls import SSMJob
from .loading import load_configured, model_spec
from .store import RequestStore, start_sweeper

if TYPE_CHECKING:
    from transformers import DynamicCache


logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    """One request's SSM state: the KV cache of its committed tokens (each draft's generator is
    made from the committed length: ``Assignment.generator``)."""

    cache: DynamicCache | PagedSequence | CrossState
    committed: list[int] = field(default_factory=list)  # every committed token, root last
    guard: Guard = field(default_factory=Guard)
    ahead: Ahead = field(init=False)  # drafting ahead for the step being verified, under the guard's lock

    def __post_init__(self) -> None:
        self.ahead = Ahead(self.guard.lock)


@dataclass(frozen=True)
class DraftTiming:
    """Wall-clock interval of one draft call (time.time(), comparable across local processes)."""

    request_id: str
    start: float
    end: float


class SSMActor(HoldsRequests):
    """Hosts ``config.ssms[index]`` as proposer ``index`` (its place in the engine's order)."""

    def __init__(self, config: EngineConfig, index: int, torch_threads: int):
        self.compute = ComputeThread()
        self.compute.run(self._load, config, index, torch_threads)

    def _load(self, config: EngineConfig, index: int, torch_threads: int) -> None:
        """What ``__init__`` does, on the compute thread (``actors.common.ComputeThread``)."""
        setup_process(torch_threads, config.server.ssm_actor.cpu_affinity)
        model_config = config.ssms[index]
        loaded = load_configured(config, model_config)
        self.index, self.name = index, model_config.name
        self.paged = config.server.batching.enabled and not model_config.cross_vocabulary
        self._dropper = make_dropper(self._forget)
        self.store: RequestStore[DraftState] = RequestStore(config.server.request_ttl_s, on_drop=self._on_drop)
        self.drafter, self.vocabulary = self._drafter(config, loaded)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.context_tokens = model_config.context_tokens
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(config.server.request_ttl_s))
        self.timings: deque[DraftTiming] = deque(maxlen=4096)
        self.pool = ThreadPoolExecutor(config.server.max_concurrent_requests, thread_name_prefix="prefetch")
        self.init_loop(DraftSide({index: self.drafter}))  # the engine loop's calls (draft_batch)

    def _drafter(self, config: EngineConfig, loaded: LoadedModel) -> tuple[object, Vocabulary]:
        """The drafter and the vocabulary its proposals are in: over a paged pool (25% larger: its
        releases may arrive after the verifier admitted more) or a DynamicCache per request; with
        ``cross_vocabulary``, drafting through text into the target's vocabulary (its tokenizer loaded
        without weights)."""
        model_config = config.ssms[self.index]
        if model_config.cross_vocabulary:
            target = load_header(model_spec(config, config.target))
            drafter = CrossVocabDrafter(loaded.model, loaded.tokenizer, target.tokenizer, self.index, self.name)
            return drafter, vocabulary(target)
        if self.paged:
            pool, batcher = batching_parts(config, loaded.model, lambda: len(self.store), scale=SSM_POOL_SCALE,
                                           burst=False)
            return PagedDrafter(loaded.model, self.index, self.name, pool, batcher), vocabulary(loaded)
        return ModelDrafter(loaded.model, self.index, self.name), vocabulary(loaded)

    def ready(self) -> tuple[str, Vocabulary]:
        """Its name and the vocabulary its proposals are in (the target's, for a cross-vocabulary SSM)."""
        return self.name, self.vocabulary

    def translation_counts(self) -> TranslationCounts | None:
        """A cross-vocabulary SSM's totals: SSM tokens drafted, target tokens that survived re-encoding;
        None for an SSM of the target's vocabulary."""
        return self.drafter.counts if isinstance(self.drafter, CrossVocabDrafter) else None

    @on_compute_thread
    def draft_batch(self, jobs: list[SSMJob]) -> list[Drafted | BaseException]:
        """The engine loop's draft phase here: every job's tree, one packed forward per tree level for
        all of them (``engine.phases.DraftSide``). Per job its Drafted (``draft_ms``: the whole
        call's drafting) or its own error (NeedsResync when this actor lacks the history's start)."""
        began, start_s, results, drafting = time.perf_counter(), time.time(), [], []
        with self.loop_lock:
            for job in jobs:
                try:
                    history = self.loop_history(job.request_id, job.start, job.new_tokens)
                except NeedsResync as error:
                    results.append(error)
                    continue
                results.append(None)
                drafting.append((len(results) - 1, DraftJob(job.request_id, history, (job.assignment,))))
            drafts = self.loop_side.draft([job for _, job in drafting])
        draft_ms, end_s = (time.perf_counter() - began) * 1e3, time.time()
        for index, job in drafting:
            draft = drafts[job.request_id][self.index]
            results[index] = draft
            if isinstance(draft, Drafted):
                results[index] = replace(draft, draft_ms=draft_ms)
                self.timings.append(DraftTiming(job.request_id, start_s, end_s))  # the batch's interval
        return results

    def draft(self, request_id: str, start: int, new_tokens: list[int], assignment: Assignment,
              prefetch: int = 0) -> Drafted | None:
        """Draft one tree for a request (its state is created on first use); None once released.

        ``new_tokens``: the committed tokens from offset ``start`` on (only those this actor has not
        seen; NeedsResync when it lacks earlier ones). The cache rolls itself forward. A tree drafted
        ahead for exactly these committed tokens is used as it is. ``prefetch`` > 0: then draft ahead
        for that many outcomes of this tree.
        """
        state = self.store.get_or_create(request_id, lambda: DraftState(self.drafter.new_state()))
        if state is None:
            return None
        committed, start_s = state.committed[:start] + list(new_tokens), time.time()

        def ready() -> bool:  # with the request's lock
            if state.guard.dropped:
                return False
            sync_history(state.committed, start, new_tokens)
            return True

        prefetch = prefetch if isinstance(self.drafter, ModelDrafter) else 0  # drafting through text: never ahead
        drafted = state.ahead.draft(self.drafter, state.cache, committed, assignment, prefetch, self.pool, ready)
        if drafted is not None:
            self.timings.append(DraftTiming(request_id, start_s, time.time()))
        return drafted

    def _on_drop(self, state: DraftState) -> None:
        """Release a request's state (release, TTL sweep) once no call or prefetch of it runs; a
        running prefetch is told to stop after the tree it is drafting."""
        state.ahead.announce(())
        self._dropper(state)

    def _forget(self, state: DraftState) -> None:
        state.ahead.close(self.drafter, state.cache)  # prepared entries first: a paged pool's blocks
        self.drafter.release(state.cache)

    def batch_counters(self):
        return self.drafter.batcher.counters if self.paged else None

    def pool_blocks(self) -> tuple[int, int, int] | None:
        """(free, unreserved, total) blocks of the paged pool, or None without one."""
        return self.drafter.pool.counts() if self.paged else None

    def draft_timings(self) -> list[DraftTiming]:
        return list(self.timings)
