"""The verifier actor: the target model and each request's KV cache, sampling and generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.build import load_target
from cluster.config import EngineConfig
from engine.draft import Proposal
from engine.generate import first_token, verify_tree
from engine.models import eos_token_ids
from engine.sampling import SamplingParams, make_generator
from engine.target import TargetState
from engine.verify import Verdict

from .common import HoldsRequests, StateLost, Vocabulary, setup_process, sweep_interval, vocabulary
from .store import RequestStore, start_sweeper


@dataclass
class VerifyState:
    target: TargetState
    sampling: SamplingParams
    generator: torch.Generator


@dataclass(frozen=True)
class TargetInfo:
    """What the ingress needs from the target: its tokenizer, EOS ids, context and vocabulary."""

    name: str
    tokenizer: object
    eos_ids: frozenset[int]
    max_context: int | None
    vocabulary: Vocabulary


class VerifierActor(HoldsRequests):
    def __init__(self, config: EngineConfig, torch_threads: int, name_prefix: str = "specinfer",
                 namespace: str | None = None):
        setup_process(torch_threads)
        self.target, loaded = load_target(config, name_prefix, namespace)
        self.info = TargetInfo(config.target.name, loaded.tokenizer, eos_token_ids(loaded),
                               getattr(loaded.model.config, "max_position_embeddings", None), vocabulary(loaded))
        self.store: RequestStore[VerifyState] = RequestStore(config.server.request_ttl_s)
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(config.server.request_ttl_s))

    def ready(self) -> TargetInfo:
        return self.info

    def shutdown(self) -> None:
        """Stop tensor-parallel ranks cleanly (their shared memory too); nothing to do at tp=1."""
        if hasattr(self.target, "shutdown"):
            self.target.shutdown()

    def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> int | None:
        """Create the request's state, run the prompt, return the first token (None: released)."""
        state = VerifyState(self.target.new_state(), sampling, make_generator(sampling.seed, 0))
        if not self.store.put(request_id, state):
            return None
        logits = self.target.prefill(state.target, prompt_ids)  # [V]
        return first_token(logits, sampling, state.generator)

    def verify(self, request_id: str, proposal: Proposal) -> Verdict | None:
        """One target forward over the tree, verification and commit; None once released."""
        state = self.store.get(request_id)
        if state is None:
            if self.store.was_released(request_id):
                return None
            raise StateLost(f"verifier has no state for request {request_id} (was the actor restarted?)")
        return verify_tree(self.target, state.target, proposal, state.sampling, state.generator)
