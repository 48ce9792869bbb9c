"""One neural SSM per actor: the model plus each request's draft cache and generator."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from cluster.build import load_configured
from settings.config import EngineConfig
from engine.batched import PagedDrafter
from engine.draft import DraftSpec, ModelDrafter, Proposal
from engine.paged import PagedSequence
from engine.sampling import make_generator

from .paging import Guard, batching_parts, make_dropper
from .common import HoldsRequests, Vocabulary, setup_process, sweep_interval, vocabulary
from .store import RequestStore, start_sweeper


@dataclass
class DraftState:
    """One request's SSM state: the KV cache of its committed tokens and its random stream."""

    cache: DynamicCache | PagedSequence
    generator: torch.Generator
    guard: Guard = field(default_factory=Guard)


@dataclass(frozen=True)
class DraftTiming:
    """Wall-clock interval of one draft call (time.time(), comparable across local processes)."""

    request_id: str
    start: float
    end: float


class SSMActor(HoldsRequests):
    """Hosts ``config.ssms[index]`` as proposer ``index`` (its place in the engine's order)."""

    def __init__(self, config: EngineConfig, index: int, torch_threads: int):
        setup_process(torch_threads)
        model_config = config.ssms[index]
        loaded = load_configured(config, model_config)
        self.index, self.name = index, model_config.name
        self.paged = config.server.batching.enabled
        self.store: RequestStore[DraftState] = RequestStore(
            config.server.request_ttl_s, on_drop=make_dropper(lambda state: self.drafter.release(state.cache)))
        if self.paged:  # a 25% larger pool: its releases may arrive after the verifier admitted more
            pool, batcher = batching_parts(config, loaded.model, lambda: len(self.store), scale=1.25)
            self.drafter = PagedDrafter(loaded.model, index, model_config.name, pool, batcher)
        else:
            self.drafter = ModelDrafter(loaded.model, index, model_config.name)
        self.vocabulary: Vocabulary = vocabulary(loaded)
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(config.server.request_ttl_s))
        self.timings: deque[DraftTiming] = deque(maxlen=4096)

    def ready(self) -> tuple[str, Vocabulary]:
        return self.name, self.vocabulary

    def draft(self, request_id: str, committed: list[int], spec: DraftSpec, seed: int | None) -> Proposal | None:
        """Draft one tree for a request (its state is created on first use); None once released.

        ``committed`` is every committed token, root last: the cache rolls itself forward.
        """
        state = self.store.get_or_create(
            request_id, lambda: DraftState(self.drafter.new_state(), make_generator(seed, self.index + 1)))
        if state is None:
            return None
        with state.guard.lock:
            if state.guard.dropped:
                return None
            start = time.time()
            proposal = self.drafter.draft(state.cache, committed, spec, state.generator)
        self.timings.append(DraftTiming(request_id, start, time.time()))
        return proposal

    def batch_counters(self):
        return self.drafter.batcher.counters if self.paged else None

    def pool_blocks(self) -> tuple[int, int, int] | None:
        """(free, unreserved, total) blocks of the paged pool, or None without one."""
        return self.drafter.pool.counts() if self.paged else None

    def draft_timings(self) -> list[DraftTiming]:
        return list(self.timings)
