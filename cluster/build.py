"""Build the in-process engine from the validated config (plain values go into ``engine``).

Model loading itself is ``actors.loading`` / ``actors.targets`` (the actors load the same way).
"""

from __future__ import annotations

import os

import torch

from actors.loading import load_configured
from actors.targets import load_target
from engine.draft import ModelDrafter, NgramDrafter
from engine.generate import SpeculativeEngine
from engine.models import check_same_vocabulary, eos_token_ids
from engine.requests import SpeculationOptions
from settings.config import EngineConfig

from .local_ray import start_local_ray


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
                              min_confidence=s.min_confidence)


def build_engine(config: EngineConfig) -> SpeculativeEngine:
    """Load the target and every SSM, check one vocabulary, and assemble the in-process engine.

    A tensor-parallel target runs its ranks as Ray actors: a local Ray node is started (or
    ``RAY_ADDRESS`` joined) unless Ray is already initialised.
    """
    set_threads(config.torch_threads)
    if config.verifier.tensor_parallel_size > 1:
        _ensure_ray()
    target_model, target = load_target(config)
    drafters: list = []
    for index, ssm_config in enumerate(config.ssms):
        ssm = load_configured(config, ssm_config)
        check_same_vocabulary(target, ssm)
        drafters.append(ModelDrafter(ssm.model, index, ssm_config.name))
    if config.ngram:
        n = config.ngram
        drafters.append(NgramDrafter(len(drafters), n.name, n.max_ngram, n.min_ngram, n.max_tokens, n.max_matches))
    return SpeculativeEngine(target_model, drafters, target.tokenizer, eos_token_ids(target))


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        start_local_ray(os.environ.get("RAY_ADDRESS"))
