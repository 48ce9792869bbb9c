"""Build the in-process engine from the validated config (plain values go into ``engine``).

Model loading itself is ``actors.loading`` / ``actors.targets`` (the actors load the same way).
"""

from __future__ import annotations

import logging
import os

import torch

from actors.loading import auto_chose_cpu_bf16, check_bf16_curve, load_configured
from actors.suffix import SuffixDrafter
from actors.targets import load_target
from engine.cross_vocab import CrossVocabDrafter
from engine.draft import ModelDrafter
from engine.budget import budget_from_curve, measure_target_curve
from engine.generate import SpeculativeEngine
from engine.loop import LoopLimits
from engine.paged_models import PagedTarget, paged_drafter, paged_target
from engine.graphed_models import GraphedDrafter, GraphedTarget
from engine.graphs import GraphRunner, graphable
from engine.target import TargetModel
from engine.shape import TreeCost
from engine.models import check_same_vocabulary, eos_token_ids
from engine.requests import SpeculationOptions
from settings.config import EngineConfig

from .local_ray import start_local_ray

logger = logging.getLogger(__name__)


def close_engine(engine: SpeculativeEngine) -> None:
    """Stop what the engine started outside this process (tensor-parallel ranks)."""
    engine.target.shutdown()


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def speculation_options(config: EngineConfig) -> SpeculationOptions:
    s = config.speculation
    return SpeculationOptions(mode=s.mode, expansion=tuple(s.expansion), sequence_depth=s.sequence_depth,
                              children=s.children, max_tree_nodes=s.max_tree_nodes,
                              min_confidence=s.min_confidence, policy=s.policy, prefetch=s.prefetch)


def tree_cost(config: EngineConfig, curve: dict[int, float] | None) -> TreeCost | None:
    """The cost model of cost-aware shapes from a measured verify-cost curve (None: schedules)."""
    if not curve or not config.cost_aware_shapes:
        return None
    c = config.speculation.cost
    return TreeCost(tuple(sorted(curve.items())), c.beam, c.branch, c.max_depth)


def forget_responses(engine: SpeculativeEngine) -> None:
    """Empty the suffix proposer's global store, so that the next request learns nothing from the
    earlier ones (benchmarks run each prompt with several methods)."""
    for drafter in engine.drafters:
        if isinstance(drafter, SuffixDrafter):
            drafter.forget_responses()


def build_engine(config: EngineConfig, batched: bool = False) -> SpeculativeEngine:
    """Load the target and every SSM, check one vocabulary (or, for an SSM with ``cross_vocabulary``,
    draft through text), and assemble the in-process engine.

    ``batched``: the target and SSMs over paged KV pools (``server.batching``: pool size, block size,
    prefill chunk), so the engine loop runs every running request's trees in one packed forward, up
    to ``server.max_concurrent_requests`` at once, with the tree budget of ``server.tree_budget``;
    otherwise each model's forwards run one request at a time. A tensor-parallel target runs its
    ranks as Ray actors: a local Ray node is started (or ``RAY_ADDRESS`` joined) unless Ray is
    already initialised.
    """
    set_threads(config.torch_threads)
    if config.verifier.tensor_parallel_size > 1:
        _ensure_ray()
    target_model, target = load_target(config)
    graphs = 0 if batched else graph_capacity(config, target_model)
    if graphs:
        target_model = GraphedTarget(GraphRunner(target_model.model, graphs))
    elif batched:
        target_model = _paged_target(config, target_model)
    drafters: list = []
    for index, ssm_config in enumerate(config.ssms):
        ssm = load_configured(config, ssm_config)
        if ssm_config.cross_vocabulary:  # drafts through text (engine.cross_vocab)
            drafters.append(CrossVocabDrafter(ssm.model, ssm.tokenizer, target.tokenizer, index, ssm_config.name))
            continue
        check_same_vocabulary(target, ssm)
        drafters.append(_drafter(config, ssm.model, index, ssm_config.name, graphs, batched))
        drafters[-1].context_tokens = ssm_config.context_tokens
    if config.suffix:
        drafters.append(SuffixDrafter(len(drafters), config.suffix))
    curve = None
    if config.cost_aware_shapes or (batched and config.tree_budget_applies):
        curve = measure_target_curve(target_model, config.speculation.cost.curve_max_tokens, float("inf"))
        logger.info("verify-cost curve (tokens per pass -> ms): %s", {size: round(ms, 1) for size, ms in curve.items()})
        if auto_chose_cpu_bf16(config, target):
            check_bf16_curve(config.target.name, curve)
    return SpeculativeEngine(target_model, drafters, target.tokenizer, eos_token_ids(target),
                             max_context=_graph_context(config, target_model) if graphs else None,
                             cost=tree_cost(config, curve), limits=_limits(config, batched),
                             tree_budget=_tree_budget(config, curve) if batched else None,
                             draft_gate=config.server.tree_budget.draft_gate)


def _paged_target(config: EngineConfig, target_model: TargetModel) -> PagedTarget:
    """The target over a pool of ``server.batching.kv_cache_tokens`` slots (one model, one process)."""
    if not isinstance(target_model, TargetModel):
        raise ValueError("a batched in-process engine needs the one-rank target (verifier.tensor_parallel_size: 1)")
    b = config.server.batching
    return paged_target(target_model.model, b.kv_cache_tokens, b.block_size)


def _drafter(config: EngineConfig, model, index: int, name: str, graphs: int, batched: bool):
    """An SSM's drafter: over a CUDA-graph buffer, over a paged pool (batched: a 25% larger pool, as
    the served SSM actors have), or over a DynamicCache per request."""
    if graphs and graphable(model.config):
        return GraphedDrafter(GraphRunner(model, graphs), index, name)
    if not batched:
        return ModelDrafter(model, index, name)
    b = config.server.batching
    return paged_drafter(model, index, name, b.kv_cache_tokens, b.block_size, b.prefill_chunk_tokens)


def _limits(config: EngineConfig, batched: bool) -> LoopLimits | None:
    """The loop's batch and queue: ``server.max_concurrent_requests`` running and 4x that waiting,
    prompts in ``server.batching.prefill_chunk_tokens`` chunks (None: the engine's defaults)."""
    if not batched:
        return None
    limit = config.server.max_concurrent_requests
    return LoopLimits(limit, 4 * limit, config.server.batching.prefill_chunk_tokens)


def _tree_budget(config: EngineConfig, curve: dict[int, float] | None):
    """Nodes per tree with R running requests (``server.tree_budget``), None where it does not apply."""
    if not curve or not config.tree_budget_applies:
        return None
    b = config.server.tree_budget
    return budget_from_curve(curve, b.slack, b.min_tree_nodes, b.disable_above_running).per_request


def _graph_context(config: EngineConfig, target_model: GraphedTarget) -> int:
    """The most tokens a request may have over CUDA graphs: ``cuda_graph_tokens``, within the model's context."""
    return min(config.cuda_graph_tokens, getattr(target_model.model.config, "max_position_embeddings", None) or 1 << 62)


def graph_capacity(config: EngineConfig, target_model) -> int:
    """KV slots of each CUDA-graph buffer (``EngineConfig.cuda_graphs``), 0 for none: a request's
    ``cuda_graph_tokens`` plus room for every proposer's tree (up to ``max_tree_nodes`` each) and the
    levels an SSM drafts. Graphs need CUDA and the plain one-rank target."""
    if not (config.cuda_graphs and isinstance(target_model, TargetModel) and target_model.model.device.type == "cuda"):
        return 0
    if not graphable(target_model.model.config):
        logger.info("cuda_graphs: the target's sliding window or softcap is not graphed; forwards run eagerly")
        return 0
    return config.cuda_graph_tokens + (len(config.proposer_names()) + 1) * config.speculation.max_tree_nodes


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        start_local_ray(os.environ.get("RAY_ADDRESS"))
