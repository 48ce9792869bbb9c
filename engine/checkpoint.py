"""Reading a safetensors checkpoint block by block into a model built without weights.

Two uses: a tensor-parallel rank reads only its own slices of the target (``actors.sharded``
says which, from DeepSpeed AutoTP's own description of each shard), and a single-device target
is filled tensor by tensor from the file, so no second full copy of it exists on the host.

The checkpoint is read with ``os.preadv`` at the offsets the safetensors header gives, not through
``safetensors.safe_open``: ``safe_open`` maps the file, and every page a slice touches stays in the
process's RSS until the map goes; a slice along dim 1 (a row-parallel weight: half of each row)
touches nearly every page of the tensor. Read with ``preadv``, a rank's RSS holds its shard and
one tensor's slice in flight, and ``Checkpoint.bytes_read`` counts exactly what was read.
Example::

    checkpoint = Checkpoint.open("/models/qwen")                 # model.safetensors or an index
    checkpoint.read("model.layers.0.mlp.down_proj.weight", Block((0, 4480), (1536, 4480)))  # [1536, 4480]
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX_FILE = "model.safetensors.index.json"
# What is fetched of a hub model (snapshot_download's allow_patterns): safetensors (never pickled
# .bin / .pt weights), configs and tokenizer files.
HUB_FILES = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: its file, dtype, shape and first byte's offset in the file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def end(self) -> int:
        """The file offset just past the tensor's last byte."""
        return self.offset + math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Block:
    """A box of a tensor: per dimension its first index and its size.
    Example: the second half of the columns of a [4, 6] tensor -> Block((0, 3), (4, 3))."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Block:
        return cls((0,) * len(shape), tuple(shape))


class Checkpoint:
    """The tensors of a safetensors checkpoint (a file, or a directory with one file or an index)."""

    def __init__(self, entries: dict[str, TensorEntry]):
        self.entries = entries
        self.bytes_read = 0  # every byte read from the files so far
        self._count = threading.Lock()  # reads may run in several threads (fill_parameters)

    @classmethod
    def open(cls, source: str | Path) -> Checkpoint:
        """Read the headers; raises FileNotFoundError when ``source`` holds no safetensors file."""
        return cls({name: entry for path in safetensors_files(Path(source)) for name, entry in read_header(path)})

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str, block: Block | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``block`` of tensor ``name`` (all of it when None) [block.sizes, in the checkpoint's dtype],
        read from disk in as few runs as the layout allows: one per index of the dimensions before the
        last one the block cuts. ``out``: a contiguous CPU tensor of that shape and dtype to read into."""
        entry = self.entries[name]
        block = block or Block.whole(entry.shape)
        check_block(name, entry.shape, block)
        out = torch.empty(block.sizes, dtype=entry.dtype) if out is None else out
        if not out.is_contiguous() or out.dtype != entry.dtype or tuple(out.shape) != block.sizes:
            raise ValueError(f"cannot read {name!r} {block} into a {out.dtype} tensor of shape {tuple(out.shape)}")
        if out.numel() == 0:
            return out
        raw = memoryview(out.view(-1).view(torch.uint8).numpy())
        itemsize = out.element_size()
        with open(entry.path, "rb", buffering=0) as handle:
            position = 0
            for start, length in runs(entry.shape, block):
                _read_exactly(handle.fileno(), raw[position:position + length * itemsize],
                              entry.offset + start * itemsize)
                position += length * itemsize
        with self._count:
            self.bytes_read += position
        return out


def safetensors_files(source: Path) -> list[Path]:
    """The checkpoint's files: ``source`` itself, the files its index names, or its one .safetensors."""
    source = source.expanduser()
    if source.is_file():
        return [source]
    index = source / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [source / name for name in sorted(set(weight_map.values()))]
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source}: no .safetensors checkpoint (nor {INDEX_FILE})")
    return files


def read_header(path: Path) -> Iterator[tuple[str, TensorEntry]]:
    """(name, entry) for each tensor in one safetensors file (its JSON header, after 8 length bytes)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
        yield name, TensorEntry(path, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                8 + length + info["data_offsets"][0])


def check_block(name: str, shape: tuple[int, ...], block: Block) -> None:
    """Raise ValueError unless ``block`` lies inside a tensor of ``shape``."""
    inside = len(block.starts) == len(block.sizes) == len(shape) and all(
        0 <= start and 0 <= size and start + size <= dim for start, size, dim in zip(block.starts, block.sizes, shape))
    if not inside:
        raise ValueError(f"block {block} of tensor {name!r} lies outside its shape {shape}")


def runs(shape: tuple[int, ...], block: Block) -> Iterator[tuple[int, int]]:
    """(first element, element count) of each contiguous run of ``block`` in a row-major tensor of
    ``shape``, in order. Example: shape (4, 6), Block((0, 3), (4, 3)) -> (3, 3), (9, 3), (15, 3), (21, 3)."""
    if not shape:
        yield 0, 1
        return
    strides = [math.prod(shape[axis + 1:]) for axis in range(len(shape))]
    cut = max([axis for axis in range(len(shape)) if block.sizes[axis] != shape[axis]] or [0])
    length = block.sizes[cut] * strides[cut]
    outer = [range(block.starts[axis], block.starts[axis] + block.sizes[axis]) for axis in range(cut)]
    for index in itertools.product(*outer):
        yield sum(i * s for i, s in zip(index, strides)) + block.starts[cut] * strides[cut], length


def _read_exactly(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` from ``fd`` at ``offset`` (``preadv`` may return short)."""
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count <= 0:
            raise OSError(f"unexpected end of checkpoint file at byte {offset + done}")
        done += count


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no gradients) while
    their buffers (rotary frequencies and the like, computed in ``__init__``, not in the checkpoint)
    are real: as accelerate's ``init_empty_weights(include_buffers=False)``."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if type(param) is torch.nn.Parameter and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@dataclass(frozen=True)
class Piece:
    """One block of a checkpoint tensor and where its elements land in a parameter's row-major
    storage (``torch.as_strided`` arguments over the flat parameter: ``block.sizes``, ``strides``,
    ``offset``). A parameter held whole is one piece: its whole block at offset 0."""

    block: Block
    offset: int
    strides: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Piece:
        return cls(Block.whole(shape), 0, tuple(math.prod(shape[axis + 1:]) for axis in range(len(shape))))


def checkpoint_names(model: torch.nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Each parameter name of ``model`` (tied ones under every name) -> the checkpoint tensor that
    holds it: its own name, or the name of a parameter it is tied to (an output head tied to the
    input embeddings is saved once, as the embeddings). Raises ValueError naming what is missing."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    names, missing = {}, []
    for group in groups.values():
        found = [name for name in group if name in checkpoint]
        missing += [] if found else group
        names.update({name: found[0] for name in group} if found else {})
    if missing:
        raise ValueError(f"the checkpoint holds no tensor for {missing[:5]} ({len(missing)} missing)")
    return names


READ_CHUNK_BYTES = 16 << 20  # a piece is read in row chunks of at most this (unless one row is larger)
LOAD_THREADS = 4  # parameters filled at once


@torch.no_grad()
def fill_parameters(model: torch.nn.Module, checkpoint: Checkpoint, names: dict[str, str],
                    pieces_for=lambda name, param: None) -> int:
    """Copy each parameter's pieces from the checkpoint into it, in place (converted to its dtype
    and device; the parameters are allocated, e.g. by ``to_empty``). ``pieces_for(name, param)``:
    the param's pieces, None for the whole tensor. Persistent buffers the checkpoint holds are read
    too. Returns the elements written; raises ValueError when pieces do not cover a parameter.

    A piece in the parameter's own dtype that lands contiguously in CPU memory is read straight
    into it; any other is read in row chunks of at most ``READ_CHUNK_BYTES`` and copied, so loading
    holds no copy of a whole tensor beside the parameters. ``LOAD_THREADS`` parameters are filled
    at once (reads and copies release the GIL), each thread reading its chunks into one buffer of
    its own (``scratch``): no allocation per chunk, whose freed memory glibc's per-thread arenas
    would keep (the process's peak grew by hundreds of MB with them)."""
    def fill(item: tuple[str, torch.nn.Parameter]) -> int:
        name, param = item
        pieces = pieces_for(name, param) or [Piece.whole(tuple(param.shape))]
        if sum(math.prod(piece.block.sizes) for piece in pieces) != param.numel():
            raise ValueError(f"the pieces of {name!r} do not cover its shard {tuple(param.shape)}")
        fill_pieces(param.data.view(-1), checkpoint, names[name], pieces)
        return param.numel()

    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        written = sum(pool.map(fill, list(model.named_parameters())))
    for name, buffer in model.named_buffers():
        if name in checkpoint:
            buffer.copy_(checkpoint.read(name))
    return written


_SCRATCH = threading.local()  # per thread: the buffer chunks are read into (no allocation per chunk)


def scratch(sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # -> sizes, dtype
    """This thread's read buffer as a tensor of ``sizes`` and ``dtype`` (grown when a chunk needs more)."""
    nbytes = math.prod(sizes) * dtype.itemsize
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _SCRATCH.buffer = torch.empty(max(nbytes, READ_CHUNK_BYTES), dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(sizes)


def fill_pieces(flat: torch.Tensor, checkpoint: Checkpoint, name: str, pieces: list[Piece]) -> None:
    """Read tensor ``name``'s ``pieces`` into ``flat`` (a parameter's storage, viewed flat)."""
    source = checkpoint.entries[name]

    def view(piece: Piece) -> torch.Tensor:
        return flat.as_strided(piece.block.sizes, piece.strides, flat.storage_offset() + piece.offset)

    with torch.no_grad():  # grad mode is per thread
        for piece in pieces:
            target = view(piece)
            if target.device.type == "cpu" and target.dtype == source.dtype and target.is_contiguous():
                checkpoint.read(name, piece.block, out=target)
                continue
            for chunk in row_chunks(piece, source.dtype.itemsize):
                view(chunk).copy_(checkpoint.read(name, chunk.block, out=scratch(chunk.block.sizes, source.dtype)))


def row_chunks(piece: Piece, itemsize: int, limit: int | None = None) -> Iterator[Piece]:
    """``piece`` cut along its first dimension into pieces of at most ``limit`` bytes (at least one
    row each). Example: sizes (10, 4), 4-byte items, limit 64 -> rows 0-3, 4-7, 8-9."""
    sizes, starts, limit = piece.block.sizes, piece.block.starts, limit or READ_CHUNK_BYTES
    if not sizes:
        yield piece
        return
    step = max(1, limit // max(1, math.prod(sizes[1:]) * itemsize))
    for first in range(0, sizes[0], step):
        count = min(step, sizes[0] - first)
        yield Piece(Block((starts[0] + first, *starts[1:]), (count, *sizes[1:])),
                    piece.offset + first * piece.strides[0], piece.strides)


class NotDirect(ValueError):
    """The checkpoint cannot fill the model built from its config (a tensor missing under the model's
    own names, a dtype the reader does not know): the caller loads with from_pretrained instead."""


def build_empty(config, dtype: torch.dtype, attn_implementation: str = "sdpa", directory: Path | None = None,
                trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM of ``config`` in ``dtype`` with its parameters on the meta device (buffers real),
    and the generation config of ``directory`` where it has one."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    if directory is not None:
        try:
            model.generation_config = GenerationConfig.from_pretrained(directory)
        except (OSError, ValueError):  # no generation_config.json: the one from_config made stays
            pass
    return model


def allocate(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter uninitialised memory of its shape and dtype on ``device``, in
    place; tied parameters stay one."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                         requires_grad=False)
                module._parameters[name] = made[id(param)]


def load_direct(directory: Path, config, dtype: torch.dtype, device: torch.device,
                attn_implementation: str = "sdpa", trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of ``config`` filled from the safetensors checkpoint in ``directory`` tensor by
    tensor on ``device``: no full copy on the host beside it (from_pretrained converting a bf16 file
    to float32 on the CPU held the mapped file and the converted model at once: the default 1.5B
    target peaked at 10.3 GiB RSS for 6.6 GiB of weights, 7.2 GiB read so). Raises ``NotDirect``
    when it cannot."""
    try:
        checkpoint = Checkpoint.open(directory)
    except (FileNotFoundError, ValueError) as error:
        raise NotDirect(str(error)) from error
    model = build_empty(config, dtype, attn_implementation, directory, trust_remote_code)
    try:
        names = checkpoint_names(model, checkpoint)
    except ValueError as error:
        raise NotDirect(str(error)) from error
    allocate(model, device)
    fill_parameters(model, checkpoint, names)
    return model.eval()
