"""The verifier actor: the target model and each request's KV cache, sampling and generator."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from settings.config import EngineConfig
from engine.requests import StepOutcome
from engine.phases import TargetSide
from engine.step import TARGET_STREAM, Drafted, first_token, root_only_proposal, verify_and_commit
from engine.models import eos_token_ids
from engine.sampling import SamplingParams, make_generator
from engine.paged_models import packed_timer
from engine.budget import CURVE_SWEEPS, measure_curve, measure_target_curve
from engine.kv_pool import PagedSequence, PoolExhausted, StateLost
from engine.target import TargetState

from .guard import Guard, make_dropper
from .loop_calls import PrefillJob, StepReply, TreeJob
from .loading import auto_chose_cpu_bf16, check_bf16_curve
from .targets import build_target
from .common import (ComputeThread, HoldsRequests, Vocabulary, on_compute_thread, setup_process, sweep_interval,
                     vocabulary)
from .store import RequestStore, start_sweeper

logger = logging.getLogger(__name__)


@dataclass
class VerifyState:
    target: TargetState | PagedSequence
    sampling: SamplingParams
    generator: torch.Generator
    guard: Guard = field(default_factory=Guard)


@dataclass(frozen=True)
class TargetInfo:
    """What the ingress needs from the target: its tokenizer, EOS ids, context and vocabulary."""

    name: str
    tokenizer: object
    eos_ids: frozenset[int]
    max_context: int | None
    vocabulary: Vocabulary
    kv_capacity_tokens: int | None = None  # the paged pool's size (None: no pool)


class VerifierActor(HoldsRequests):
    def __init__(self, config: EngineConfig, torch_threads: int, name_prefix: str = "specinfer",
                 namespace: str | None = None):
        self.compute = ComputeThread()
        self.compute.run(self._load, config, torch_threads, name_prefix, namespace)

    def _load(self, config: EngineConfig, torch_threads: int, name_prefix: str, namespace: str | None) -> None:
        """What ``__init__`` does, on the compute thread (``actors.common.ComputeThread``)."""
        setup_process(torch_threads, config.verifier.actor.cpu_affinity)
        self.paged = config.server.batching.enabled
        self.store: RequestStore[VerifyState] = RequestStore(
            config.server.request_ttl_s, on_drop=make_dropper(lambda state: self.target.release(state.target)))
        self.target, loaded = build_target(config, lambda: len(self.store), name_prefix, namespace)
        capacity = self.target.pool.num_slots if self.paged else None
        self.config = config
        self.auto_bf16 = auto_chose_cpu_bf16(config, loaded)  # checked against the verify-cost curve
        self.info = TargetInfo(config.target.name, loaded.tokenizer, eos_token_ids(loaded),
                               getattr(loaded.model.config, "max_position_embeddings", None), vocabulary(loaded),
                               capacity)
        self._stop_sweeper = start_sweeper(self.store, sweep_interval(config.server.request_ttl_s))
        # the engine loop's calls (step_batch): its own states, one call at a time
        chunk = config.server.batching.prefill_chunk_tokens if self.paged else None
        self.init_loop(TargetSide(self.target, chunk))

    @on_compute_thread
    def measure_verify_cost(self) -> dict[int, float] | None:
        """ms of one verify pass vs tokens in it (None when neither the tree budget, which needs
        batching, nor cost-aware shapes use it).

        Called by the ingress once every actor has loaded, so that loading does not skew it.
        """
        budget, config = self.config.server.tree_budget, self.config
        by_budget = config.tree_budget_applies
        if not (by_budget or config.cost_aware_shapes):
            return None
        # Cost-aware shapes read the whole curve; the budget alone needs it up to its slack limit.
        slack = float("inf") if config.cost_aware_shapes else budget.slack
        sizes = max(budget.max_total_tokens if by_budget else 1,
                    config.speculation.cost.curve_max_tokens if config.cost_aware_shapes else 1)
        if self.paged:
            # One prefill for every size; each size a median over interleaved sweeps, as unbatched.
            with packed_timer(self.target.batcher.model, repeats=1) as time_pass:
                curve = measure_curve(time_pass, sizes, slack, CURVE_SWEEPS)
        else:
            curve = measure_target_curve(self.target, sizes, slack)
        logger.info("verify-cost curve (tokens per pass -> ms): %s", {k: round(v, 1) for k, v in curve.items()})
        if self.auto_bf16:
            check_bf16_curve(config.target.name, curve)
        return curve

    def ready(self) -> TargetInfo:
        return self.info

    @on_compute_thread
    def step_batch(self, merged: dict | None, trees: list[TreeJob], prefills: list[PrefillJob],
                   released: tuple[str, ...] = ()) -> StepReply:
        """The engine loop's verify phase: one target pass over every tree and each prompt's next
        chunk (``engine.phases.TargetSide``). ``merged``: the merge actor's trees by request (None:
        none drafted); a request without one (its draft failed, an SSM or the merge actor is down)
        is verified as its root alone, plain decoding, which is lossless. ``released``: requests the
        loop let go since its last call, dropped before any admission (``ActorExecutor.release``)."""
        results, resync, trees_by_id, began = {}, [], {}, time.perf_counter()
        with self.loop_lock:
            for request_id in released:  # the loop let them go: their blocks count free for this call's admissions
                self.drop_loop_state(request_id)
            for job in prefills:
                if job.first and not self._admit(job, results):
                    continue
            for job in trees:
                drafted = (merged or {}).get(job.request_id)
                if not isinstance(drafted, Drafted):
                    if drafted is not None:
                        logger.warning("request %s verified without a tree: %r", job.request_id, drafted)
                        resync.append(job.request_id)
                    drafted = Drafted(root_only_proposal(job.root))
                trees_by_id[job.request_id] = drafted
            chunks = [job.request_id for job in prefills if job.request_id not in results]
            results.update(self.loop_side.verify(trees_by_id, chunks))
            self.count_pass(len(trees_by_id) + len(chunks))
            return StepReply(results, tuple(resync), self.loop_side.kv_blocks(), (time.perf_counter() - began) * 1e3)

    def _admit(self, job: PrefillJob, results: dict) -> bool:
        """Make a new request's state; its failure goes into ``results``."""
        try:
            if self.loop_side.admit(job.request_id, job.prompt_ids, job.sampling, job.reserve_tokens):
                return True
            results[job.request_id] = PoolExhausted(f"no KV memory for {job.reserve_tokens} tokens; retry later")
        except Exception as error:
            results[job.request_id] = error
        return False


    def shutdown(self) -> None:
        """Stop tensor-parallel ranks cleanly (their shared memory too); nothing to do at tp=1."""
        self.target.shutdown()

    def batch_counters(self):
        return self.target.batcher.counters if self.paged else None

    def hold_next_batch(self, count: int) -> None:
        """The next packed forward waits for ``count`` requests (tests: sharing made certain)."""
        self.target.batcher.hold_next(count)

    def pool_blocks(self) -> tuple[int, int, int] | None:
        """(free, unreserved, total) blocks of the paged pool, or None without one."""
        return self.target.pool.counts() if self.paged else None

    def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                reserve_tokens: int = 0) -> int | None:
        """Create the request's state, run the prompt, return the first token (None: released).

        With a paged pool the request's worst case (``reserve_tokens``) is reserved first; if the
        pool cannot promise it, PoolExhausted is raised and nothing is kept (admission).
        """
        target_state = self.target.new_state(reserve_tokens)
        state = VerifyState(target_state, sampling, make_generator(sampling.seed, TARGET_STREAM))
        if not self.store.put(request_id, state):
            self.target.release(target_state)
            return None
        with state.guard.lock:
            if state.guard.dropped:
                return None
            logits = self.target.prefill(state.target, prompt_ids)  # [V]
            return first_token(logits, sampling, state.generator)

    def verify(self, request_id: str, drafted: Drafted | None) -> StepOutcome | None:
        """One target forward over the tree, verification and commit; None once released.

        ``drafted`` arrives from the merge actor as an object reference: the ingress never holds it.
        """
        state = self.store.get(request_id)
        if state is None:
            if self.store.was_released(request_id):
                return None
            raise StateLost(f"verifier has no state for request {request_id} (was the actor restarted?)")
        if drafted is None:
            return None
        with state.guard.lock:
            if state.guard.dropped:
                return None
            return verify_and_commit(self.target, state.target, drafted, state.sampling, state.generator)
