"""Loading Hugging Face causal LMs as target or SSM, with the checks tree verification needs."""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import itertools
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from .architectures import LAYER_KINDS, REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from .checkpoint import NotDirect, load_direct
from .fused_int8 import fuse_int8_siblings
from .packed import use_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: a hub id, a local directory, or a .gguf file."""

    name: str
    source: str
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    gguf_file: str | None = None
    revision: str | None = None
    device: str = "auto"  # "auto": CUDA when available (a Ray actor sees its own GPU as cuda:0)


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    model: PreTrainedModel
    tokenizer: object


HUB_TOKEN_ENV = "HF_TOKEN"  # the hub token is read from the environment, never from a config or a log


def pretrained_args(spec: ModelSpec) -> tuple[str, dict]:
    """(path or id, keyword arguments) for from_pretrained, resolving a .gguf file path. A hub id
    gets its ``revision`` and the token of ``$HF_TOKEN`` (when set); nothing here logs the kwargs.
    Example: ``org/model`` at revision ``abc123`` with HF_TOKEN set ->
    ("org/model", {"trust_remote_code": False, "revision": "abc123", "token": <HF_TOKEN>})."""
    hub = _looks_like_hub_id(spec.source)
    source = spec.source if hub else str(Path(spec.source).expanduser())
    kwargs: dict = {"trust_remote_code": spec.trust_remote_code}
    if spec.revision:
        kwargs["revision"] = spec.revision
    if hub and os.environ.get(HUB_TOKEN_ENV):
        kwargs["token"] = os.environ[HUB_TOKEN_ENV]
    gguf_file = spec.gguf_file
    if gguf_file is None and source.endswith(".gguf"):
        source, gguf_file = str(Path(source).parent), Path(source).name
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return source, kwargs


def redacted(text: str, kwargs: dict) -> str:
    """``text`` with the hub token of ``kwargs`` (if any) replaced by ``***``."""
    token = kwargs.get("token")
    return text.replace(token, "***") if token else text


class ModelSourceError(OSError):
    """A model's files could not be read from its source (hub id or directory); the message names
    the model, its source and revision, never the token."""


def hub_call(spec: ModelSpec, kwargs: dict, function, *args, **more):
    """``function(*args, **kwargs, **more)`` (a from_pretrained or download); an OSError it raises
    (no such repo or revision, no access, no network) becomes a ``ModelSourceError`` naming the
    model and its source, with the token redacted and the original cause cut off (it may quote it)."""
    try:
        return function(*args, **kwargs, **more)
    except OSError as error:
        where = f"{spec.source}" + (f" at revision {spec.revision}" if spec.revision else "")
        message = redacted(f"model {spec.name!r}: cannot read {where}: {error}", kwargs)
    raise ModelSourceError(message)


def _looks_like_hub_id(source: str) -> bool:
    return not Path(source).expanduser().exists() and source.count("/") == 1 and not source.startswith((".", "/", "~"))


# Families on the allow-list that DeepSpeed AutoTP (0.19) shards wrongly (found with 2 CPU ranks).
NOT_TENSOR_PARALLEL = {
    **dict.fromkeys(("olmo2", "olmo3"), "its q/k norms span every head's projection, and AutoTP leaves them "
                                        "whole while it splits the projections"),
    "phi3": "its fused qkv projection is split by the whole model's head counts, not by a rank's",
}


def check_tensor_parallel(config, name: str, tensor_parallel_size: int) -> None:
    """Raise ValueError where a target of ``config``'s family cannot be sharded over more than one rank."""
    model_type = getattr(config, "model_type", "?")
    if tensor_parallel_size > 1 and model_type in NOT_TENSOR_PARALLEL:
        raise ValueError(f"verifier.tensor_parallel_size {tensor_parallel_size}: target {name!r} ({model_type}) "
                         f"cannot be sharded by DeepSpeed AutoTP: {NOT_TENSOR_PARALLEL[model_type]}; use "
                         "tensor_parallel_size: 1")


def check_architecture(config, name: str) -> None:
    """Raise ValueError unless the config is a decoder-only family on the allow-list whose layers are
    full or sliding-window attention; the message names the model and the reason."""
    model_type = getattr(config, "model_type", "?")
    reason = refusal(config)
    if reason is not None:
        raise ValueError(f"model {name!r} has architecture {model_type!r}, which tree verification does not "
                         f"support: {reason}")


def refusal(config) -> str | None:
    """Why tree verification cannot serve ``config`` (None: it can)."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model: tree verification runs decoder-only causal LMs"
    if model_type in REFUSED_ARCHITECTURES:
        return REFUSED_ARCHITECTURES[model_type]
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return "ALiBi position biases are added inside attention from key indices, not from a tree's positions"
    if model_type not in SUPPORTED_ARCHITECTURES:
        return f"no test covers it (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    kinds = set(getattr(config, "layer_types", None) or LAYER_KINDS[:1]) - set(LAYER_KINDS)
    if kinds:
        return f"layer types {sorted(kinds)} are neither full nor sliding-window attention"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model) is not causal"
    return None


def attention_for(config, requested: str) -> str:
    """The attention implementation to load ``config``'s model with: ``requested``, but "eager" where
    its layers softcap attention logits (gemma2), which SDPA cannot do (transformers refuses it). The
    paged pool and the tensor-parallel ranks replace it by their own attention, which softcaps."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else requested


def load_model(spec: ModelSpec, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load a causal LM and its tokenizer; check the architecture before loading weights.
    safetensors only (or GGUF): pickled .bin / .pt weights are refused (``use_safetensors``)."""
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
    source, kwargs = pretrained_args(spec)
    config = hub_call(spec, kwargs, transformers.AutoConfig.from_pretrained, source)
    check_architecture(config, spec.name)
    logger.info("loading %s from %s (%s)", spec.name, spec.source, spec.dtype)
    device = resolve_device(spec.device)
    attention = attention_for(config, attn_implementation)
    model = _load_weights(spec, source, kwargs, config, device, attention)
    if device.type == "cpu" and spec.dtype in ("bfloat16", "float16") and attention == "sdpa":
        use_attention(model)  # SDPA unless a pass has few queries, which run as matmuls (``engine.packed.attend``)
    if device.type == "cpu" and spec.dtype == "bfloat16" and not cpu_has_bf16():
        logger.warning("%s: bfloat16 on a CPU without native bf16 (no AVX512-BF16 / AMX): matrix products are "
                       "emulated, a forward of several tokens costs several times one of a single token and "
                       "trees barely pay; float32 is faster here (dtype: float32, and cpu_linears: "
                       "onednn_packed where the target verifies trees)", spec.name)
    tokenizer = hub_call(spec, kwargs, transformers.AutoTokenizer.from_pretrained, source)
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer)


def _load_weights(spec: ModelSpec, source: str, kwargs: dict, config, device: torch.device,
                  attn_implementation: str) -> PreTrainedModel:
    """The model on ``device``: a local safetensors checkpoint filled tensor by tensor
    (``engine.checkpoint.load_direct``: no second full copy on the host), else (a hub id, a GGUF
    file, names the checkpoint does not hold) from_pretrained."""
    if "gguf_file" not in kwargs and Path(source).is_dir():
        try:
            return load_direct(Path(source), config, DTYPES[spec.dtype], device, attn_implementation,
                               spec.trust_remote_code)
        except NotDirect as why:
            logger.info("%s: loading with from_pretrained (%s)", spec.name, why)
    model = hub_call(spec, kwargs, transformers.AutoModelForCausalLM.from_pretrained, source, dtype=DTYPES[spec.dtype],
                     attn_implementation=attn_implementation, use_safetensors=None if "gguf_file" in kwargs else True,
                     **direct_placement(device))
    return model.to(device).eval()


def direct_placement(device: torch.device) -> dict:
    """from_pretrained arguments that put each tensor on a GPU as it is read (``device_map``), so
    no full copy of the model is staged in host memory first; none on the CPU, where the weights
    are read from the mapped safetensors file (in its own dtype without a copy, or converted
    tensor by tensor)."""
    return {"device_map": str(device)} if device.type == "cuda" else {}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (oneDNN's check: AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class ModelHeader:
    """A model's configs without its weights, for a process that only tokenizes and checks."""

    config: object
    generation_config: object | None


def load_header(spec: ModelSpec) -> LoadedModel:
    """Config, generation config and tokenizer only (``model`` is a ModelHeader)."""
    source, kwargs = pretrained_args(spec)
    config = hub_call(spec, kwargs, transformers.AutoConfig.from_pretrained, source)
    check_architecture(config, spec.name)
    try:
        generation = transformers.GenerationConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError):  # no generation_config.json
        generation = None
    tokenizer = hub_call(spec, kwargs, transformers.AutoTokenizer.from_pretrained, source)
    return LoadedModel(spec=spec, model=ModelHeader(config, generation), tokenizer=tokenizer)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def check_same_vocabulary(target: LoadedModel, other: LoadedModel) -> None:
    """Raise ValueError naming both models when their vocabularies differ."""
    target_size = target.model.config.vocab_size
    other_size = other.model.config.vocab_size
    if target_size != other_size or target.tokenizer.get_vocab() != other.tokenizer.get_vocab():
        raise ValueError(
            f"SSM {other.spec.name!r} ({other.spec.source}, vocab {other_size}) does not share the "
            f"vocabulary of target {target.spec.name!r} ({target.spec.source}, vocab {target_size}); "
            "speculative decoding needs one vocabulary, or set cross_vocabulary: true on the SSM to "
            "draft through text (its tokens re-encoded into the target's vocabulary)"
        )


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


def truncate_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """Keep the first ``num_layers`` decoder layers (a cheaper, weaker SSM from the same model)."""
    layers = model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Dynamic int8 quantization of the linear layers (CPU): a faster SSM; verification keeps
    the output exact whatever the SSM proposes. Sibling projections of one input (q/k/v, gate/up)
    then share one int8 product (``engine.fused_int8``), with the same outputs.

    The int8 linears compute in float32, so the model is made float32 first, in place and one
    decoder layer at a time (``_quantize_linears``): no full float32 copy exists at once. The input
    embeddings stay in the dtype they were loaded in, widened per lookup: the table is the largest
    weight left in float (0.5B Qwen: 136M of its parameters), and widening bf16 values to float32
    is exact, so the logits are the same as with a float32 table.
    """
    if model.device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on CPU only; use a bf16 SSM on GPUs")
    loaded_dtype = model.dtype
    mappings = checkpoint_mappings()
    for stack in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for block in stack:  # one decoder layer in float32 at a time, not the whole model
            _quantize_linears(block, mappings)
    _quantize_linears(model, mappings)  # the rest: the output head, the final norm
    fuse_int8_siblings(model)
    if loaded_dtype in (torch.bfloat16, torch.float16):
        embeddings = model.get_input_embeddings()
        embeddings.weight.data = embeddings.weight.data.to(loaded_dtype)
        embeddings.register_forward_hook(lambda module, args, output: output.float())
    return model


def _quantize_linears(module: torch.nn.Module, mappings: list[tuple[int, int]]) -> None:
    """Make ``module`` float32 and its ``nn.Linear`` layers dynamic int8, in place (each one as
    ``quantize_dynamic`` of the whole model would), dropping the checkpoint pages of the weights it
    converted (``drop_mapped_pages``), then trims the heap. Block by block, the default 0.5B SSM's
    loading peak is 2.4 GB for 1.3 GB held, against 4.1 GB for the whole model at once."""
    sources = [t.data for t in itertools.chain(module.parameters(), module.buffers())
               if t.is_floating_point() and t.dtype != torch.float32]
    module.float()
    for source in sources:  # converted: the module holds float32 copies now
        drop_mapped_pages(source, mappings)
    torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return_freed_memory()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``).

    Loading makes copies that are freed again (the int8 SSM: its float32 layers, the unpacked
    int8 weights), but glibc keeps freed memory in its arenas, and reuses it poorly for the next
    copies, so without this a process's RSS stays at its loading peak: the int8 0.5B SSM held 4.5 GB
    after loading, 1.6 GB after the trim (BENCHMARKS.md "Memory per actor"). A no-op where glibc
    is missing.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        logger.debug("malloc_trim unavailable: freed loading memory stays with the process")


ONEDNN_MIN_WEIGHTS = 1 << 20  # smaller linear layers stay with torch's path (oneDNN's per-call cost)


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` computed by oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``,
    the kernel torch.compile's CPU backend calls) instead of torch's default CPU path for float32,
    MKL's sgemm. Same parameters, same state dict; outputs equal ``F.linear``'s up to rounding (the
    two libraries sum in different orders, as MKL itself does for different token counts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


ONEDNN_PACK_ROWS = 8  # the token count a packed weight's layout is chosen for: a tree's verify pass


class PackedOneDNNLinear(OneDNNLinear):
    """A ``OneDNNLinear`` whose weight is kept in oneDNN's blocked layout, reordered once at load for
    products of about ``ONEDNN_PACK_ROWS`` rows (as torch.compile's CPU freezing does), instead of
    being reordered inside every call of more than one row. The weight parameter is an mkldnn tensor
    of the same size; the state dict holds the plain weight (``to_dense``, exact) and loading one
    packs it again."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight.detach().to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        self.weight = torch.nn.Parameter(self.weight.detach().to_dense(), requires_grad=False)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.weight = torch.nn.Parameter(pack_weight(self.weight), requires_grad=False)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, in] (mkldnn layout)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)


def onednn_linears(model: torch.nn.Module, min_weights: int = ONEDNN_MIN_WEIGHTS, packed: bool = False) -> int:
    """Route a CPU model's float32 ``nn.Linear`` layers of at least ``min_weights`` weights through
    oneDNN (``OneDNNLinear``, in place; with ``packed``, ``PackedOneDNNLinear``: weights reordered
    once, except weights another module shares, such as tied embeddings, which must stay plain);
    returns how many were switched (0 on other devices, other dtypes, or where oneDNN is missing).

    Why: on AMD CPUs MKL's sgemm takes a slow path for a few rows. Measured on a 2-core AVX2 AMD
    EPYC, one [M, 1536] x [1536, 8960] product: M = 1 / 4 / 8 / 16 rows 3.7 / 13.2 / 11.5 / 13.9 ms
    with MKL, 2.4 / 6.5 / 5.1 / 7.5 ms with oneDNN; the 1.5B target's forward over 1 / 8 tokens
    518 / 2087 ms against 362 / 949 ms. A verify pass over a tree is exactly such a product of a
    few rows. oneDNN costs about 30 us more per call, so smaller layers stay with torch (same box,
    [1536 -> 256] over 8 rows: 107 us with MKL, 126 with oneDNN; [1536 -> 1536]: 867 against 654).
    With a plain weight oneDNN reorders it inside each product of more than one row; packed, the
    same box's target forward over 6 tokens took 514 ms against 670 (median of six), over one
    token 376 against 338.

    bf16 layers are switched only ``packed`` and where the CPU multiplies bf16 natively: torch
    already hands them to oneDNN there, with plain weights, reordered inside every product. Packed
    once, the default target's bf16 forward on a 2-core AMX Xeon took 152 / 154 / 158 / 166 ms at
    1 / 4 / 8 / 16 tokens against 179 / 186 / 189 / 198 (its 28 layers' products alone: 102 against
    125 ms at one token, about 26 against 21 GB/s of weights read). fp16 layers are left alone.
    """
    dtypes = {torch.float32} | ({torch.bfloat16} if packed and cpu_has_bf16() else set())
    linears = _runnable([m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= min_weights
                         and m.weight.device.type == "cpu" and m.weight.dtype in dtypes], packed)
    if not linears:
        return 0
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    mappings = checkpoint_mappings()
    for module in linears:
        source = module.weight
        use_onednn(module, packed and uses[id(module.weight)] == 1)
        if module.weight is not source:  # packed: a copy; the checkpoint's pages it was read from can go
            drop_mapped_pages(source, mappings)
    if packed:
        own_weights(model, mappings)
    return len(linears)


@torch.no_grad()
def own_weights(model: torch.nn.Module, mappings: list[tuple[int, int]] | None = None) -> None:
    """Copy the plain parameters and buffers into memory of their own, so that the checkpoint's
    memory map is released once packing has replaced the large weights.

    A model loaded in its checkpoint's dtype reads its weights from the mapped safetensors file; a
    packed weight is a copy, but the mapping stays while any tensor (embeddings, norms, small
    projections) still reads from it, and the pages packing read stay counted in the process's
    RSS. The default bf16 target: 6.2 GB RSS after packing, 3.8 GB with this (3.3 GB packed).
    Each source's pages leave the RSS as soon as it is copied (``drop_mapped_pages`` over
    ``mappings``, read now if not given), so the copies never sit beside a resident checkpoint.
    """
    mappings = checkpoint_mappings() if mappings is None else mappings
    for tensor in [p for p in model.parameters() if not p.is_mkldnn] + list(model.buffers()):
        source = tensor.data
        tensor.data = source.clone()
        drop_mapped_pages(source, mappings)


def checkpoint_mappings() -> list[tuple[int, int]]:
    """The address ranges [start, end) where this process maps safetensors files (a checkpoint
    loaded in its own dtype is read from such a map), from Linux's /proc/self/maps; [] elsewhere.
    Example line: ``7fa001800000-7fa011899000 rw-p 00000000 fe:00 16040013 /models/m/model.safetensors``
    -> (0x7fa001800000, 0x7fa011899000)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip().endswith(".safetensors"):
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def drop_mapped_pages(source: torch.Tensor, mappings: list[tuple[int, int]]) -> int:
    """Take the whole pages of ``source``'s bytes out of this process's RSS where they lie in one of
    the checkpoint ``mappings`` (``madvise(MADV_DONTNEED)``); returns the bytes dropped.

    For a tensor that was just copied or packed and that nothing reads any more: the pages its
    copy was read from stay resident (counted in the RSS, and so in the loading peak) until the
    whole map is released, which happens only when its last tensor is gone. The map is private, so
    a page written since loading would lose the change; a source nobody reads has nothing to lose.
    Only pages wholly inside the tensor are dropped. Example (4 KiB pages): a tensor at 0x1800 of
    0x3000 bytes in a mapping [0x0, 0x10000) -> pages [0x2000, 0x4000) dropped, 8192 returned.
    """
    if source.device.type != "cpu" or source.is_mkldnn or not mappings:
        return 0
    start = source.data_ptr()
    end = start + source.numel() * source.element_size()
    if not any(low <= start and end <= high for low, high in mappings):
        return 0
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    if _madvise()(first, last - first, mmap.MADV_DONTNEED) != 0:
        logger.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())
        return 0
    return last - first


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise(address, length, advice)``, loaded once."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def use_onednn(linear: torch.nn.Linear, packed: bool = False) -> None:
    """Switch one float32 CPU ``nn.Linear`` to oneDNN, in place; ``packed``: its weight reordered once
    (``PackedOneDNNLinear``; the weight parameter is replaced, so only for a weight nothing shares)."""
    if packed:
        linear.__class__ = PackedOneDNNLinear
        linear.weight = torch.nn.Parameter(pack_weight(linear.weight), requires_grad=False)
    else:
        linear.__class__ = OneDNNLinear


def _runnable(linears: list[torch.nn.Linear], packed: bool) -> list[torch.nn.Linear]:
    """The ``linears`` whose dtype this torch build's oneDNN computes (one probe per dtype)."""
    runs: dict[torch.dtype, bool] = {}
    for linear in linears:
        if linear.weight.dtype not in runs:
            runs[linear.weight.dtype] = _onednn_runs(linear, packed)
    return [linear for linear in linears if runs[linear.weight.dtype]]


def _onednn_runs(linear: torch.nn.Linear, packed: bool) -> bool:
    """Whether this torch build's oneDNN computes ``linear`` (probed on one row of zeros of its
    dtype), with its weight packed if ``packed``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            weight = pack_weight(linear.weight) if packed else linear.weight
            zeros = torch.zeros(1, linear.in_features, dtype=linear.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(zeros, weight, linear.bias, "none", [], "")
    except (RuntimeError, AttributeError) as error:
        logger.info("oneDNN linears unavailable (%s): torch's default CPU path stays", error)
        return False
    return True

