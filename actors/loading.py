"""Load a configured model: the config's model entry -> ``engine.models`` spec -> a LoadedModel.

Used by the actors (SSM, verifier, tensor-parallel ranks) and by ``cluster.build`` for the
in-process engine. Example::

    config = load_config("configs/default.yaml")
    ssm = load_configured(config, config.ssms[0])   # truncated / int8-quantized as configured
"""

from __future__ import annotations

from engine.models import (LoadedModel, ModelSpec, load_model, onednn_linears, quantize_int8, return_freed_memory,
                           truncate_layers)
from engine.offload import OffloadSpec, load_offloaded
from settings.config import EngineConfig, ModelConfig


def model_spec(config: EngineConfig, model: ModelConfig) -> ModelSpec:
    """Where ``model`` comes from, with the engine-wide defaults (dtype, device, models dir) filled in."""
    return ModelSpec(
        name=model.name,
        source=config.resolve_source(model.source),
        dtype=config.model_dtype(model),
        trust_remote_code=model.trust_remote_code,
        gguf_file=model.gguf_file,
        revision=model.revision,
        device=config.device,
    )


def load_configured(config: EngineConfig, model: ModelConfig) -> LoadedModel:
    """Load one model and apply its layer truncation / quantization / CPU linear kernels, or stream
    it (``offload``)."""
    if model.offload is not None:
        return load_offloaded(model_spec(config, model), OffloadSpec(**model.offload.model_dump()))
    loaded = load_model(model_spec(config, model))
    if model.num_layers:
        truncate_layers(loaded.model, model.num_layers)
    if model.quantize == "int8":
        loaded = LoadedModel(loaded.spec, quantize_int8(loaded.model), loaded.tokenizer)
    kernels = config.linears_for(model)
    if kernels != "torch":  # after quantizing: int8 linears are not nn.Linear and keep fbgemm
        onednn_linears(loaded.model, packed=kernels == "onednn_packed")
    return_freed_memory()
    return loaded
