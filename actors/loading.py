"""Load a configured model: the config's model entry -> ``engine.models`` spec -> a LoadedModel.

Used by the actors (SSM, verifier, tensor-parallel ranks) and by ``cluster.build`` for the
in-process engine. Example::

    config = load_config("configs/default.yaml")
    ssm = load_configured(config, config.ssms[0])   # truncated / int8-quantized as configured
"""

from __future__ import annotations

import dataclasses
import logging

from engine.budget import grows_with_tokens
from engine.dtypes import machine_dtype
from engine.models import (LoadedModel, ModelSpec, load_model, onednn_linears, quantize_int8, resolve_device,
                           return_freed_memory, truncate_layers)
from engine.offload import OffloadSpec, load_offloaded
from settings.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def model_spec(config: EngineConfig, model: ModelConfig) -> ModelSpec:
    """Where ``model`` comes from, with the engine-wide defaults (dtype, device, models dir) filled in.
    Its dtype may still be ``auto``: ``load_configured`` resolves it where the weights load."""
    return ModelSpec(
        name=model.name,
        source=config.resolve_source(model.source),
        dtype=config.model_dtype(model),
        trust_remote_code=model.trust_remote_code,
        gguf_file=model.gguf_file,
        revision=model.revision,
        device=config.device,
    )


def resolved_dtype(config: EngineConfig, model: ModelConfig, device: str | None = None) -> str:
    """The dtype ``model`` loads in here: as configured, or ``auto`` resolved for this machine and
    the device the model runs on (``device``, default the config's), with one INFO line saying why."""
    dtype = config.model_dtype(model)
    if dtype != "auto":
        return dtype
    return _resolve_auto(model.name, device.split(":")[0] if device else resolve_device(config.device).type)


def with_dtype_resolved(config: EngineConfig) -> EngineConfig:
    """``config`` with a top-level ``dtype: auto`` resolved for this machine, for a driver whose
    models all load on it (the benchmarks, in-process and served on one box), so that what it
    records names the dtype measured. A model's own ``auto`` still resolves where it loads."""
    if config.dtype != "auto":
        return config
    return config.model_copy(update={"dtype": _resolve_auto("engine", resolve_device(config.device).type)})


def _resolve_auto(label: str, device_type: str) -> str:
    """This machine's ``auto`` dtype for ``device_type``, logged with the reason."""
    choice = machine_dtype(device_type)
    logger.info("%s: %s", label, choice.describe())
    return choice.dtype


def load_configured(config: EngineConfig, model: ModelConfig, dtype_device: str | None = None) -> LoadedModel:
    """Load one model and apply its layer truncation / quantization / CPU linear kernels, or stream
    it (``offload``). ``dtype_device``: the device ``auto`` resolves for when the model loads on
    another first (tensor-parallel ranks load on the CPU, then move to their GPU)."""
    spec = dataclasses.replace(model_spec(config, model), dtype=resolved_dtype(config, model, dtype_device))
    if model.offload is not None:
        return load_offloaded(spec, OffloadSpec(**model.offload.model_dump()))
    loaded = load_model(spec)
    if model.num_layers:
        truncate_layers(loaded.model, model.num_layers)
    if model.quantize == "int8":
        loaded = LoadedModel(loaded.spec, quantize_int8(loaded.model), loaded.tokenizer)
    kernels = config.linears_for(model, spec.dtype)
    if kernels != "torch":  # after quantizing: int8 linears are not nn.Linear and keep fbgemm
        onednn_linears(loaded.model, packed=kernels == "onednn_packed")
    return_freed_memory()
    return loaded


def auto_chose_cpu_bf16(config: EngineConfig, loaded: LoadedModel) -> bool:
    """Whether ``dtype: auto`` loaded the target in bfloat16 on this process's CPU."""
    device = getattr(loaded.model, "device", None)
    return (config.model_dtype(config.target) == "auto" and loaded.spec.dtype == "bfloat16"
            and device is not None and device.type == "cpu")


def check_bf16_curve(name: str, curve: dict[int, float] | None) -> bool:
    """After ``auto`` chose bfloat16 on the CPU: warn when the verify-cost curve measured at start
    grows about in proportion to the tokens (engine.budget.grows_with_tokens), as emulated bf16
    products do. Only a warning: the model is not reloaded. Returns whether it warned."""
    if not curve or not grows_with_tokens(curve):
        return False
    logger.warning("%s: dtype auto chose bfloat16, but the verify-cost curve grows about in proportion to the "
                   "tokens (%s): bf16 looks emulated on this CPU, and trees barely pay; set dtype: float32",
                   name, {size: round(ms, 1) for size, ms in sorted(curve.items())})
    return True
