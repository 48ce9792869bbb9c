"""Build engine objects from the validated config (plain values go into ``engine``)."""

from __future__ import annotations

import logging
import os

import torch

from engine.draft import ModelDrafter, NgramDrafter
from engine.requests import SpeculationOptions
from engine.generate import SpeculativeEngine
from engine.models import (LoadedModel, ModelSpec, check_same_vocabulary, eos_token_ids, load_header, load_model,
                           quantize_int8, truncate_layers)
from engine.target import TargetModel

from settings.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def model_spec(config: EngineConfig, model: ModelConfig) -> ModelSpec:
    return ModelSpec(
        name=model.name,
        source=config.resolve_source(model.source),
        dtype=model.dtype or config.dtype,
        trust_remote_code=model.trust_remote_code,
        gguf_file=model.gguf_file,
        revision=model.revision,
        device=config.device,
    )


def load_configured(config: EngineConfig, model: ModelConfig) -> LoadedModel:
    """Load one model and apply its layer truncation / quantization."""
    loaded = load_model(model_spec(config, model))
    if model.num_layers:
        truncate_layers(loaded.model, model.num_layers)
    if model.quantize == "int8":
        loaded = LoadedModel(loaded.spec, quantize_int8(loaded.model), loaded.tokenizer)
    return loaded


def load_target(config: EngineConfig, name_prefix: str = "specinfer", namespace: str | None = None):
    """The target as (TargetModel or TensorParallelTarget, LoadedModel for its tokenizer and configs).

    With ``verifier.tensor_parallel_size`` > 1 the weights load in the rank actors (Ray must be
    initialised); this process loads the tokenizer and configs only.
    """
    if config.verifier.tensor_parallel_size == 1:
        loaded = load_configured(config, config.target)
        return TargetModel(loaded.model), loaded
    import ray

    from actors.tensor_parallel import TensorParallelTarget

    if not ray.is_initialized():
        from .cli_serve import start_local_ray

        start_local_ray(os.environ.get("RAY_ADDRESS"))
    header = load_header(model_spec(config, config.target))
    return TensorParallelTarget(config, header.model, name_prefix, namespace), header


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
    """Load the target and every SSM, check one vocabulary, and assemble the in-process engine."""
    set_threads(config.torch_threads)
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
