"""One neural SSM per actor: the model plus each request's draft cache and generator."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cluster.build import load_configured
from cluster.config import EngineConfig
from engine.draft import DraftSpec, ModelDrafter, Proposal
from engine.sampling import make_generator

from .common import HoldsRequests, Vocabulary, setup_process, sweep_interval, vocabulary
from .store import RequestStore, start_sweeper


@dataclass
class DraftState:
    """One request's SSM state: the KV cache of its committed tokens and its random stream."""

    cache: DynamicCache
    generator: torch.Generator


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
        self.drafter = ModelDrafter(loaded.model, index, model_config.name)
        self.vocabulary: Vocabulary = vocabulary(loaded)
        self.store: RequestStore[DraftState] = RequestStore(config.server.request_ttl_s)
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
        start = time.time()
        proposal = self.drafter.draft(state.cache, committed, spec, state.generator)
        self.timings.append(DraftTiming(request_id, start, time.time()))
        return proposal

    def draft_timings(self) -> list[DraftTiming]:
        return list(self.timings)
