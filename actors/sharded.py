"""A tensor-parallel rank's shard of the target, read from the checkpoint slice by slice.

The target is built on the meta device (no weights), sharded there by DeepSpeed AutoTP with the
same policy the ranks run (``deepspeed.init_inference``, kernel injection off), and each parameter
of this rank is then filled from the safetensors checkpoint by reading only the blocks AutoTP
assigned to it (``engine.checkpoint``), so a rank's host memory peaks at about its shard plus one
tensor's slice, not at the whole target.

Which blocks: AutoTP describes every parameter it shards as an affine map (DeepSpeed's universal
checkpoint metadata, ``ds_autotp_universal_checkpoint_meta``: per rank, the pieces of the full
tensor its shard holds and where they land). The pieces are read as they stand, so the shard
equals what AutoTP cuts from a fully loaded model, column or row splits, uneven head splits and
fused sub-parameters alike; a parameter AutoTP does not shard is read whole.

Why not DeepSpeed's own checkpoint loading (``init_inference(checkpoint=...)``): for AutoTP it
loads every checkpoint file whole on every rank (``safetensors.torch.load_file`` or
``torch.load``, then slices), so a rank's peak is a whole file (the default target is one 3.5 GB
file) and pickled ``.bin`` files would be accepted. Why not ``safe_open(...).get_slice``: it maps the
file, and the pages a slice touches count in the rank's RSS until the map is dropped; a row-parallel
slice (half of each row) touches nearly all of them. See ``engine.checkpoint``.

A target the checkpoint cannot fill this way (a tensor it lacks under the model's own names, a
layout without an affine map, a scaled piece, a GGUF file) raises ``NotShardable``; the rank then
loads the whole target and shards it, as before, with a warning saying why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint import HUB_FILES, Block, Checkpoint, Piece, build_empty, checkpoint_names, fill_parameters
from engine.models import DTYPES, ModelSpec, attention_for, check_architecture, hub_call, pretrained_args

UC_META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META


class NotShardable(ValueError):
    """The checkpoint cannot be read slice by slice for this target (the reason says why)."""


@dataclass(frozen=True)
class ShardLoad:
    """What one rank read: its module (sharded, weights filled), the bytes read from the checkpoint
    and the elements written into its parameters."""

    module: torch.nn.Module
    bytes_read: int
    elements: int


def load_rank_shard(spec: ModelSpec, world_size: int, rank: int) -> ShardLoad:
    """Rank ``rank``'s AutoTP shard of ``spec``'s target, read slice by slice (module docstring).
    Needs the rank's process group up; raises ``NotShardable`` when the checkpoint does not allow it."""
    import deepspeed  # rank processes only (slow, and it reads the environment)

    if spec.gguf_file or spec.source.endswith(".gguf"):
        raise NotShardable("a GGUF checkpoint is dequantized by transformers as a whole")
    directory, checkpoint, config = open_checkpoint(spec)
    model = build_empty(config, DTYPES[spec.dtype], attention_for(config, "sdpa"), directory, spec.trust_remote_code)
    try:
        names = checkpoint_names(model, checkpoint)
    except ValueError as error:
        raise NotShardable(str(error)) from error
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=DTYPES[spec.dtype],
                                      replace_with_kernel_inject=False)  # on meta: allocates only the shard
    module = engine.module
    restore_buffers(module, buffers)
    describe_shards(module)
    elements = fill_parameters(module, checkpoint, names, lambda name, param: rank_pieces(name, param, rank))
    return ShardLoad(module.eval(), checkpoint.bytes_read, elements)


def open_checkpoint(spec: ModelSpec) -> tuple[Path, Checkpoint, object]:
    """(its local directory, the checkpoint's headers, the checked model config) for ``spec``,
    downloaded first when it is a hub id (``local_checkpoint``)."""
    from transformers import AutoConfig

    directory = local_checkpoint(spec)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=spec.trust_remote_code)
    check_architecture(config, spec.name)
    try:
        return directory, Checkpoint.open(directory), config
    except (FileNotFoundError, ValueError) as error:
        raise NotShardable(str(error)) from error


def local_checkpoint(spec: ModelSpec) -> Path:
    """``spec``'s directory: its source when local, else the hub snapshot at its revision (with the
    token of $HF_TOKEN, safetensors and tokenizer files only), downloaded into the hub cache."""
    source, kwargs = pretrained_args(spec)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    download = {key: kwargs[key] for key in ("revision", "token") if key in kwargs}
    return Path(hub_call(spec, download, snapshot_download, repo_id=source, allow_patterns=list(HUB_FILES)))


def restore_buffers(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put back the buffers computed at build (rotary frequencies): ``to_empty`` left them undefined."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def describe_shards(module: torch.nn.Module) -> None:
    """Have every AutoTP layer describe its parameters again: the descriptions were set on the meta
    parameters, which ``to_empty`` replaced by new ones."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    for layer in module.modules():
        if isinstance(layer, TensorParallel_Layer):
            layer._mark_uc_metadata()


def rank_pieces(name: str, param: torch.Tensor, rank: int) -> list[Piece] | None:
    """The pieces of the full tensor that ``param`` (rank ``rank``'s shard) holds, from AutoTP's
    affine map; None when AutoTP left it whole. Raises ``NotShardable`` for a layout it cannot read."""
    meta = getattr(param, UC_META, None)
    if meta is None:
        return None
    affine = meta.get("conversion", {}).get("affine_map")
    if affine is None:
        raise NotShardable(f"AutoTP gives no affine map for {name!r} ({meta.get('partition_type')})")
    ranks = {int(key): value for key, value in affine["ranks"].items()}
    if tuple(ranks[rank]["shard_shape"]) != tuple(param.shape):
        raise NotShardable(f"{name!r}: AutoTP's map gives rank {rank} {ranks[rank]['shard_shape']}, "
                           f"the shard is {tuple(param.shape)}")
    return [piece_block(name, tuple(affine["logical_shape"]), piece) for piece in ranks[rank]["pieces"]
            if 0 not in piece["shape"]]  # an empty share (a rank AutoTP gave no columns) reads nothing


def piece_block(name: str, shape: tuple[int, ...], piece: dict) -> Piece:
    """One affine piece as a block of the full tensor: its source strides must be the full tensor's
    own (a box of it) and its scale 1. Example: shape (64, 64), source offset 32, strides (64, 1),
    piece shape (64, 32) -> Block((0, 32), (64, 32))."""
    strides = tuple(math.prod(shape[axis + 1:]) for axis in range(len(shape)))
    sizes = tuple(piece["shape"])
    (source_offset, source_strides), (dest_offset, dest_strides) = piece["source"], piece["dest"]
    if piece.get("scale", 1.0) != 1.0 or len(sizes) != len(shape) or any(
            size > 1 and stride != full for size, stride, full in zip(sizes, tuple(source_strides), strides)):
        raise NotShardable(f"{name!r}: an AutoTP piece that is not a plain block of the tensor: {piece}")
    starts, rest = [], source_offset
    for stride in strides:
        starts.append(rest // stride)
        rest %= stride
    return Piece(Block(tuple(starts), sizes), dest_offset, tuple(dest_strides))
