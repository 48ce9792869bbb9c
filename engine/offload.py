"""A target larger than memory: decoder layers streamed in for every forward pass (SpecInfer's
offloading-based inference).

The model is the ordinary Hugging Face module, so every target (``TargetModel``, ``PagedTarget``)
and the served path use it unchanged. Only its decoder layers' parameters are not resident:

    tier "disk"  each pass reads every streamed layer from the safetensors file with O_DIRECT
                 (aligned spans, sliced), so the page cache holds nothing and RAM stays small;
                 ``direct_io: false`` reads normally and drops the pages (POSIX_FADV_DONTNEED)
    tier "host"  the streamed layers live in host memory (pinned on CUDA) and are copied to the
                 model's device on a side stream; on a CPU model this is a copy per pass

A loader thread fills ``prefetch_layers + 1`` slots in layer order, so reading layer i+1..i+k
overlaps computing layer i; after the last layer it goes on with the next pass's first layers
(which overlaps drafting). ``embed_tokens``, ``lm_head``, the final norm and the first
``resident_layers`` decoder layers stay resident. Example::

    loaded = load_offloaded(ModelSpec("t", "/models/qwen", "bfloat16"), OffloadSpec("disk", 0, 2))
    target = TargetModel(loaded.model)          # verification, batching, serving: unchanged
    streamer_of(loaded.model).stats()           # bytes read, passes, ms waited for weights
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .checkpoint import Checkpoint, TensorEntry, checkpoint_names, parameters_on_meta
from .models import DTYPES, LoadedModel, ModelSpec, attention_for, check_architecture, pretrained_args, resolve_device

logger = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block size (<= 4 KiB)
TIERS = ("disk", "host")


@dataclass(frozen=True)
class OffloadSpec:
    """Where streamed weights live and how many layers stay resident or are read ahead."""

    tier: str = "disk"
    resident_layers: int = 0
    prefetch_layers: int = 2
    direct_io: bool = True
    read_threads: int = 2  # concurrent reads of one layer (a virtio disk reads ~30 % faster with 2-4)

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"offload tier must be one of {TIERS}, got {self.tier!r}")
        if self.resident_layers < 0 or self.prefetch_layers < 1 or self.read_threads < 1:
            raise ValueError("offload needs resident_layers >= 0, prefetch_layers >= 1 and read_threads >= 1")


@dataclass(frozen=True)
class Run:
    """A contiguous aligned read: file span [start, start + length) into a slot at ``into``."""

    path: str
    start: int
    length: int
    into: int


@dataclass(frozen=True)
class Piece:
    """A parameter of a layer: ``key`` (its name in the layer) at byte ``offset`` of the slot."""

    key: str
    offset: int
    entry: TensorEntry


@dataclass(frozen=True)
class LayerPlan:
    """How to read one decoder layer: aligned runs into a slot, and where each parameter lies."""

    runs: tuple[Run, ...]
    pieces: tuple[Piece, ...]
    nbytes: int  # slot bytes this layer needs


def plan_layer(named: dict[str, TensorEntry], gap: int = 1 << 20) -> LayerPlan:
    """Merge a layer's tensors (name in the layer -> entry) into aligned runs.

    Example: tensors at [5000, 6000) and [6000, 9000) of one file -> one run [4096, 12288) into
    slot byte 0; the pieces lie at slot bytes 904 and 1904.
    """
    order = sorted(named.items(), key=lambda item: (item[1].path, item[1].offset))
    runs, pieces, into = [], [], 0
    group: list[tuple[str, TensorEntry]] = []

    def flush() -> None:
        nonlocal into
        start = group[0][1].offset // ALIGN * ALIGN
        end = -(-max(e.end for _, e in group) // ALIGN) * ALIGN
        runs.append(Run(group[0][1].path, start, end - start, into))
        pieces.extend(Piece(key, into + e.offset - start, e) for key, e in group)
        into += end - start
        group.clear()

    for key, entry in order:
        if group and (entry.path != group[-1][1].path or entry.offset - group[-1][1].end > gap):
            flush()
        group.append((key, entry))
    if group:
        flush()
    return LayerPlan(tuple(runs), tuple(pieces), into)


class DiskReader:
    """Reads layer runs from safetensors files into aligned buffers, past the page cache."""

    CHUNK = 16 << 20  # one pread; a layer's run is split so that ``threads`` reads are in flight

    def __init__(self, paths: set[str], direct: bool, threads: int):
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        self.direct, self.pool = direct, None
        self.fds: dict[str, int] = {}
        for path in sorted(paths):
            try:
                self.fds[path] = os.open(path, flags)
            except OSError as error:
                self.close()
                raise ValueError(f"cannot open {path} for direct reads ({error}); this file system may not "
                                 "support O_DIRECT: set target.offload.direct_io: false") from None
        self.sizes = {path: os.fstat(fd).st_size for path, fd in self.fds.items()}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="offload-read") if threads > 1 else None
        self.bytes_read = 0

    def read(self, runs: tuple[Run, ...], buffer: mmap.mmap) -> None:
        """Fill ``buffer`` at each run's ``into`` with the run's file span."""
        chunks = [Run(r.path, r.start + at, min(self.CHUNK, r.length - at), r.into + at)
                  for r in runs for at in range(0, r.length, self.CHUNK)]
        mapper = self.pool.map if self.pool else map
        self.bytes_read += sum(mapper(lambda chunk: self._read(chunk, buffer), chunks))

    def _read(self, chunk: Run, buffer: mmap.mmap) -> int:
        fd = self.fds[chunk.path]
        need = min(chunk.length, self.sizes[chunk.path] - chunk.start)  # the aligned end may pass the file's end
        with memoryview(buffer)[chunk.into:chunk.into + chunk.length] as view:
            got = os.preadv(fd, [view], chunk.start)
        if got < need:
            raise OSError(f"short read of {chunk.path} at {chunk.start}: {got} of {need} bytes")
        if not self.direct:
            os.posix_fadvise(fd, chunk.start, chunk.length, os.POSIX_FADV_DONTNEED)
        return got

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        if self.pool:
            self.pool.shutdown(wait=False)


def read_tensor(entry: TensorEntry, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor read with plain I/O (resident weights, the host tier), its pages dropped after."""
    data = bytearray(entry.end - entry.offset)
    with open(entry.path, "rb", buffering=0) as handle:
        handle.seek(entry.offset)
        if handle.readinto(data) != len(data):
            raise OSError(f"short read of {entry.path} at {entry.offset}")
        os.posix_fadvise(handle.fileno(), entry.offset, len(data), os.POSIX_FADV_DONTNEED)
    raw = torch.frombuffer(data, dtype=torch.uint8).view(entry.dtype).view(entry.shape)
    return raw.to(device=device, dtype=dtype, copy=True)


@dataclass(frozen=True)
class Fetched:
    """A layer's parameters ready to bind (name in the layer -> tensor) and, on CUDA, the copy's event."""

    tensors: dict[str, torch.Tensor]
    event: object = None


class LayerSource:
    """Produces a streamed layer's parameters into a slot: from disk (``DiskReader``) or host memory."""

    def __init__(self, plans: dict[int, LayerPlan], spec: OffloadSpec, dtype: torch.dtype, device: torch.device,
                 slots: int):
        self.plans, self.dtype, self.device = plans, dtype, device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reader, self.buffers, self.host = None, [], {}
        if spec.tier == "disk":
            self.reader = DiskReader({r.path for p in plans.values() for r in p.runs}, spec.direct_io, spec.read_threads)
            size = max(p.nbytes for p in plans.values())
            self.buffers = [mmap.mmap(-1, size) for _ in range(slots)]  # page-aligned, as O_DIRECT needs
        else:
            pin = device.type == "cuda"
            for index, plan in plans.items():
                host = {piece.key: read_tensor(piece.entry, dtype, torch.device("cpu")) for piece in plan.pieces}
                self.host[index] = {k: t.pin_memory() if pin else t for k, t in host.items()}

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read if self.reader else 0

    def fetch(self, index: int, slot: int) -> Fetched:
        if self.reader is None:
            return self._to_device(self.host[index])
        plan, buffer = self.plans[index], self.buffers[slot]
        self.reader.read(plan.runs, buffer)
        views = {p.key: torch.frombuffer(buffer, dtype=torch.uint8, count=p.entry.end - p.entry.offset,
                                         offset=p.offset).view(p.entry.dtype).view(p.entry.shape) for p in plan.pieces}
        if self.device.type == "cpu" and all(v.dtype == self.dtype for v in views.values()):
            return Fetched(views)  # zero copy: the slot's buffer is the layer's weights until released
        return self._to_device(views)

    def _to_device(self, tensors: dict[str, torch.Tensor]) -> Fetched:
        if self.copy_stream is None:
            return Fetched({k: t.to(dtype=self.dtype, copy=True) for k, t in tensors.items()})
        with torch.cuda.stream(self.copy_stream):
            moved = {k: t.to(device=self.device, dtype=self.dtype, non_blocking=True) for k, t in tensors.items()}
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return Fetched(moved, event)

    def close(self) -> None:
        if self.reader:
            self.reader.close()


@dataclass(frozen=True)
class StreamStats:
    """What streaming cost so far: bytes read from disk, passes, ms the forward waited for weights."""

    bytes_read: int
    passes: int
    layers_loaded: int
    wait_ms: float


class LayerStreamer:
    """Binds each streamed decoder layer's weights for its forward, loading ahead in a thread.

    Slots: ``prefetch + 1``. The loader takes requested layers in order while a slot is free; a
    layer's forward waits for it (``bind``) and frees its slot after (``unbind``). Requests run
    cyclically over the streamed layers, so the last layers ask for the next pass's first ones.
    A slot is always free for the layer a forward waits for: in a whole pass the loaded layers lie
    in that layer's window; a pass that raised frees its bound layer, so at most ``prefetch`` read-
    ahead layers keep slots, and they are used when a later pass reaches them.
    """

    def __init__(self, layers, streamed: list[int], source: LayerSource, prefetch: int):
        self.layers, self.streamed, self.source, self.prefetch = layers, streamed, source, prefetch
        self.places = {i: {k: _owner(layers[i], k) for k, _ in layers[i].named_parameters()} for i in streamed}
        self.empty = {i: {k: torch.nn.Parameter(p.detach(), requires_grad=False) for k, p in layers[i].named_parameters()}
                      for i in streamed}  # meta placeholders: a use outside bind fails loudly
        self.cond = threading.Condition()
        self.pending: deque[int] = deque()
        self.ready: dict[int, tuple[int, Fetched]] = {}
        self.in_use: dict[int, int] = {}
        self.failed: dict[int, BaseException] = {}
        self.free = list(range(prefetch + 1))
        self.loading: int | None = None
        self.closed = False
        self.pass_lock = threading.Lock()
        self.passes = self.loaded = 0
        self.wait_ms = 0.0
        self.thread = threading.Thread(target=self._load_loop, name="offload-loader", daemon=True)
        self.thread.start()

    def stats(self) -> StreamStats:
        with self.cond:
            return StreamStats(self.source.bytes_read, self.passes, self.loaded, self.wait_ms)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until the loader has nothing requested or loading (its read-ahead done)."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.pending and self.loading is None, timeout_s)

    def window(self, index: int) -> list[int]:
        """``index`` and the ``prefetch`` streamed layers after it, wrapping into the next pass.

        Example: streamed [2, 3, 4], prefetch 2 -> window(3) == [3, 4, 2].
        """
        at = self.streamed.index(index)
        return [self.streamed[(at + k) % len(self.streamed)] for k in range(min(self.prefetch + 1, len(self.streamed)))]

    def begin_pass(self) -> None:
        with self.cond:
            self.passes += 1

    def abort_pass(self) -> None:
        """A forward raised: drop what it left requested or bound (the next pass starts afresh)."""
        with self.cond:
            self.pending.clear()
            self.failed.clear()
            for index in list(self.in_use):
                self._unbind_locked(index)
            self.cond.notify_all()

    def bind(self, index: int) -> None:
        began = time.perf_counter()
        with self.cond:
            self._request(self.window(index))
            while index not in self.ready:
                if index in self.failed:
                    raise RuntimeError(f"reading decoder layer {index} failed") from self.failed.pop(index)
                self.cond.wait()
            slot, fetched = self.ready.pop(index)
            self.in_use[index] = slot
            self.wait_ms += (time.perf_counter() - began) * 1e3
        if fetched.event is not None:
            torch.cuda.current_stream().wait_event(fetched.event)
        for key, tensor in fetched.tensors.items():
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream())
            module, leaf = self.places[index][key]
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)

    def unbind(self, index: int) -> None:
        with self.cond:
            self._unbind_locked(index)
            self.cond.notify_all()

    def _unbind_locked(self, index: int) -> None:
        for key, placeholder in self.empty[index].items():
            module, leaf = self.places[index][key]
            module._parameters[leaf] = placeholder
        if index in self.in_use:
            self.free.append(self.in_use.pop(index))

    def _request(self, units: list[int]) -> None:
        for unit in reversed(units):  # the needed layer first, then the read-ahead in order
            if unit in self.ready or unit in self.in_use or unit == self.loading:
                continue
            self.failed.pop(unit, None)  # an earlier read's error belonged to that request: retry
            if unit in self.pending:
                self.pending.remove(unit)
            self.pending.appendleft(unit)
        self.cond.notify_all()

    def _load_loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not (self.pending and self.free):
                    self.cond.wait()
                if self.closed:
                    return
                unit, slot = self.pending.popleft(), self.free.pop()
                self.loading = unit
            try:
                fetched, error = self.source.fetch(unit, slot), None
            except BaseException as caught:  # handed to the forward that needs the layer
                fetched, error = None, caught
            with self.cond:
                self.loading = None
                if error is None:
                    self.ready[unit] = (slot, fetched)
                    self.loaded += 1
                else:
                    self.free.append(slot)
                    self.failed[unit] = error
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=30)
        self.source.close()


def _owner(layer, key: str):
    """(module, parameter name) of ``key`` ("self_attn.q_proj.weight") inside ``layer``."""
    path, _, leaf = key.rpartition(".")
    return (layer.get_submodule(path) if path else layer), leaf


def streamer_of(model) -> LayerStreamer | None:
    """The streamer of an offloaded model (None for a resident one)."""
    return model.__dict__.get("_specinfer_streamer")


def load_offloaded(spec: ModelSpec, offload: OffloadSpec, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load a causal LM whose decoder layers (past the first ``resident_layers``) are streamed."""
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
    source, kwargs = pretrained_args(spec)
    if "gguf_file" in kwargs or not Path(source).is_dir():
        raise ValueError(f"offloading model {spec.name!r} needs a local directory of safetensors weights, "
                         f"got {spec.source!r} (fetch it first: specinfer models fetch)")
    config = AutoConfig.from_pretrained(source, **kwargs)
    check_architecture(config, spec.name)
    dtype, device = DTYPES[spec.dtype], resolve_device(spec.device)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention_for(config, attn_implementation),
                                                 trust_remote_code=spec.trust_remote_code)
    model.eval()
    model.tie_weights()  # tied lm_head / embeddings share one Parameter, read once from the one entry
    _load_generation_config(model, source, kwargs)
    for module in model.modules():  # buffers (rotary frequencies) are real; move them
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    try:
        checkpoint = Checkpoint.open(source)
    except FileNotFoundError:
        raise ValueError(f"offloading needs safetensors weights: {source}/model.safetensors (or an index of "
                         "safetensors files) does not exist") from None
    entries = checkpoint.entries
    layers = model.model.layers
    streamed = list(range(min(offload.resident_layers, len(layers)), len(layers)))
    by_name = checkpoint_names(model, checkpoint)  # tied parameters share one checkpoint tensor
    names = {id(param): by_name[name] for name, param in model.named_parameters(remove_duplicate=False)}
    _load_resident(model, entries, names, {id(p) for i in streamed for p in layers[i].parameters()}, dtype, device)
    if streamed:
        plans = {i: plan_layer({k: entries[names[id(p)]] for k, p in layers[i].named_parameters()}) for i in streamed}
        source_ = LayerSource(plans, offload, dtype, device, offload.prefetch_layers + 1)
        _attach(model, LayerStreamer(layers, streamed, source_, offload.prefetch_layers))
    logger.info("%s: %d of %d decoder layers streamed from %s (%s tier, %d read ahead)", spec.name, len(streamed),
                len(layers), source, offload.tier, offload.prefetch_layers)
    return LoadedModel(spec=spec, model=model, tokenizer=AutoTokenizer.from_pretrained(source, **kwargs))


def _load_generation_config(model, source: str, kwargs: dict) -> None:
    try:
        model.generation_config = GenerationConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError):  # no generation_config.json: from_config's default stays
        pass


def _load_resident(model, entries, names: dict[int, str], streamed: set[int], dtype, device) -> None:
    """Read every parameter outside the streamed layers once; tied ones stay tied."""
    loaded: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or id(param) in streamed:
                continue
            if id(param) not in loaded:
                loaded[id(param)] = torch.nn.Parameter(read_tensor(entries[names[id(param)]], dtype, device),
                                                       requires_grad=False)
            module._parameters[leaf] = loaded[id(param)]


def _attach(model, streamer: LayerStreamer) -> None:
    """Hooks: bind a layer's weights before its forward, unbind after; one pass at a time."""
    for index in streamer.streamed:
        layer = streamer.layers[index]
        layer.register_forward_pre_hook(lambda module, args, i=index: streamer.bind(i))
        layer.register_forward_hook(lambda module, args, output, i=index: streamer.unbind(i))
    decoder = model.model
    forward = decoder.forward

    def streamed_forward(*args, **kwargs):
        with streamer.pass_lock:
            streamer.begin_pass()
            try:
                return forward(*args, **kwargs)
            except BaseException:
                streamer.abort_pass()
                raise

    decoder.forward = streamed_forward
    model.__dict__["_specinfer_streamer"] = streamer
