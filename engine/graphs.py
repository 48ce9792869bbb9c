"""One sequence's forwards over a fixed KV buffer, at fixed sizes, replayed as CUDA graphs.

On a GPU a small model's eager forward is bound by the host, not the device: on the H200 machine
(``bench/gpu_step_profile.py``) a decoder layer costs about 0.75 ms of Python and kernel launches,
so a level of the 24-layer 0.5B SSM (19 ms) costs as much as a pass of the 28-layer target and a
tree never pays. A CUDA graph replays all of a forward's kernels with one launch. Graphs need fixed
shapes and addresses, hence:

* one KV buffer per model, ``[L, H, C, D]`` for keys and for values, holds one sequence: its
  committed entries in slots ``0 .. L-1``, its speculative ones (tree nodes, drafted levels) right
  after them. ``capacity`` slots for the sequence, then ``largest size`` scratch slots;
* a forward of ``n`` new tokens gets ``committed`` (L) and ``visible [n, K]`` over the speculative
  entries once these ``n`` are appended (the last ``n`` columns are the new tokens; ``engine.packed``'s
  convention): the tokens' entries go to slots ``L + K - n .. L + K - 1``; every slot below L is
  visible, slot ``L + j`` is visible to token i where ``visible[i, j]``, no other slot;
* ``n`` is padded to the next captured size (``sizes``): padding tokens see the committed slots
  only, write to the slots after the real ones (never holding anything valid) and their rows are
  dropped. Longer forwards (prompts) and forwards with more than ``spec_slots`` speculative
  columns run eagerly over the buffer's used part. Without CUDA (or ``graphs=False``) every
  forward runs eagerly: the same code, which is how the CPU tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv import activation_dtype
from .kv_pool import head_dim, kv_heads
from .masks import sliding_window
from .packed import register_custom_attention
from .tree import attention_bias

ATTENTION = "specinfer_static"
SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StaticContext:
    """What the attention function needs: each layer's keys and values (``[1, H, C, D]`` views of
    the buffer: all of it under a graph, the used part eagerly) and the slots the new entries go to."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    write_slots: torch.Tensor  # [n]


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, static=None, **kwargs):
    """query [1, Hq, n, D], key/value [1, H, n, D] -> ([1, n, Hq, D], None): write the new entries
    to their slots, then attend over the buffer under the additive mask. Without a context it is
    plain SDPA (the model still runs the DynamicCache path)."""
    if static is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    keys, values = static.keys[module.layer_idx], static.values[module.layer_idx]
    keys.index_copy_(2, static.write_slots, key.to(keys.dtype))
    values.index_copy_(2, static.write_slots, value.to(values.dtype))
    out = F.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype), attn_mask=attention_mask,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def device_bias(
    committed: torch.Tensor,  # [1] int64
    visible: torch.Tensor,  # [n, K] bool
    columns: torch.Tensor,  # [C] int64, 0 .. C-1
    dtype: torch.dtype,
) -> torch.Tensor:  # [1, 1, n, C]
    """The additive mask over the whole buffer, built on the device from fixed-shape inputs (so a
    graph can hold it): 0 for the slots below ``committed`` and for slot ``committed + j`` where
    ``visible[:, j]``, dtype-min elsewhere.

    Example: committed [2], visible [[1, 0], [1, 1]], C 5 -> rows [0, 0, 0, min, min], [0, 0, 0, 0, min].
    """
    rel = columns - committed  # [C]
    width = visible.shape[1]
    inside = (rel >= 0) & (rel < width)
    seen = visible.gather(1, rel.clamp(0, width - 1).expand(visible.shape[0], -1)) & inside  # [n, C]
    seen |= rel < 0
    bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)
    return bias[None, None]


@dataclass(eq=False)
class StaticSequence:
    """The one sequence a runner's buffer holds: ``length`` entries are in slots 0 .. length-1
    (hashed by identity: drafters key their per-request tables by state)."""

    runner: "GraphRunner"
    length: int = 0


@dataclass(frozen=True)
class _Graph:
    """A captured forward of ``size`` tokens and its fixed inputs and output.

    inputs:  # [3 * size + 1] int64: token ids, positions, write slots, committed
    visible: # [size, spec_slots] bool
    logits:  # [size, V] float32
    """

    graph: object  # torch.cuda.CUDAGraph
    size: int
    inputs: torch.Tensor
    visible: torch.Tensor
    logits: torch.Tensor


def graphable(model_config) -> bool:
    """Whether a GraphRunner can run the model: not where a layer has a sliding window or a logit
    softcap (its attention applies only the tree mask)."""
    return sliding_window(model_config) is None and getattr(model_config, "attn_logit_softcapping", None) is None


class GraphRunner:
    """``model``'s forwards for one sequence at a time over a KV buffer of ``capacity`` slots.

    ``graphs``: replay captured CUDA graphs (default: on a CUDA device); every size is captured
    when the runner is made, before any sequence holds the buffer. ``spec_slots``: the most
    speculative columns a captured forward takes (a tree's nodes, or a draft's levels so far).
    """

    def __init__(self, model, capacity: int, sizes: tuple[int, ...] = SIZES, spec_slots: int = 128,
                 graphs: bool | None = None):
        config, self.model = model.config, model
        if not graphable(config):
            raise ValueError(f"cuda_graphs: a {config.model_type} model with a sliding window or attention logit "
                             "softcapping needs the paged pool's or the DynamicCache's attention; the graphed "
                             "buffers apply neither (set cuda_graphs: false)")
        register_custom_attention(ATTENTION, static_attention)
        model.set_attn_implementation(ATTENTION)
        self.device = next(model.parameters()).device
        self.dtype = activation_dtype(model)
        self.sizes, self.capacity, self.spec_slots = tuple(sorted(sizes)), capacity, spec_slots
        slots = capacity + self.sizes[-1]  # the scratch tail: padding and capture write there
        self.keys = torch.zeros(config.num_hidden_layers, kv_heads(config), slots, head_dim(config), dtype=self.dtype,
                                device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.columns = torch.arange(slots, device=self.device)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.holder: StaticSequence | None = None
        self._captured = {size: self._capture(size) for size in self.sizes} if self.graphs else {}

    # -- The sequence. ----------------------------------------------------------------------

    def claim(self) -> StaticSequence:
        """The buffer for a new sequence; raises RuntimeError while another holds it."""
        if self.holder is not None:
            raise RuntimeError("this model's KV buffer holds another request: one request at a time "
                               "with CUDA graphs (use batching for concurrent requests)")
        self.holder = StaticSequence(self)
        return self.holder

    def release(self, sequence: StaticSequence) -> None:
        """Give the buffer back (idempotent)."""
        if self.holder is sequence:
            self.holder = None

    # -- Forwards. --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, committed: int,  # tokens, positions [n]
                visible: torch.Tensor, last_only: bool = False) -> torch.Tensor:  # visible [n, K] -> [n or 1, V]
        """Logits (float32, on the model's device) after feeding ``tokens`` (module docstring)."""
        n, width = visible.shape
        if committed + width > self.capacity:
            raise ValueError(f"the sequence needs {committed + width} KV slots; the buffer has {self.capacity}")
        size = next((s for s in self.sizes if s >= n), None)
        if not self.graphs or size is None or width > self.spec_slots:
            return self._eager(tokens, positions, committed, visible, last_only)
        captured = self._captured[size]
        self._load(captured, tokens, positions, committed, visible)
        captured.graph.replay()
        return captured.logits[n - 1:n] if last_only else captured.logits[:n]

    def wait(self) -> None:
        """Wait for the device's queued work on the current stream (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _eager(self, tokens, positions, committed: int, visible, last_only: bool) -> torch.Tensor:
        n, end = visible.shape[0], committed + visible.shape[1]
        context = StaticContext(tuple(k[None, :, :end] for k in self.keys), tuple(v[None, :, :end] for v in self.values),
                                torch.arange(end - n, end, device=self.device))
        out = self.model(input_ids=tokens[None].to(self.device), position_ids=positions[None].to(self.device),
                         attention_mask=attention_bias(visible, committed, self.dtype).to(self.device),
                         use_cache=False, static=context, logits_to_keep=1 if last_only else 0)
        return out.logits[0].float()

    def _run(self, inputs: torch.Tensor, visible: torch.Tensor, size: int) -> torch.Tensor:  # -> [size, V]
        """A forward from a graph's fixed inputs (what a capture records)."""
        ids, positions, write, committed = inputs[:size], inputs[size:2 * size], inputs[2 * size:3 * size], inputs[-1:]
        context = StaticContext(tuple(k[None] for k in self.keys), tuple(v[None] for v in self.values), write)
        out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False, static=context,
                         attention_mask=device_bias(committed, visible, self.columns, self.dtype))
        return out.logits[0].float()

    def _capture(self, size: int) -> _Graph:
        """Warm up, then capture the forward of ``size`` tokens; its writes land in the scratch tail."""
        inputs = torch.zeros(3 * size + 1, dtype=torch.long, device=self.device)
        inputs[2 * size:3 * size] = torch.arange(self.capacity, self.capacity + size)
        inputs[-1] = self.capacity
        visible = torch.zeros(size, self.spec_slots, dtype=torch.bool, device=self.device)
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(inputs, visible, size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._run(inputs, visible, size)
        return _Graph(graph, size, inputs, visible, logits)

    def _load(self, captured: _Graph, tokens, positions, committed: int, visible) -> None:
        """Copy a forward's inputs into a graph's, padded (module docstring)."""
        n, width, size = visible.shape[0], visible.shape[1], captured.size
        host = torch.zeros(3 * size + 1, dtype=torch.long)
        host[:n], host[size:size + n] = tokens, positions
        host[2 * size:3 * size] = torch.arange(committed + width - n, committed + width - n + size)
        host[-1] = committed
        padded = torch.zeros(size, self.spec_slots, dtype=torch.bool)
        padded[:n, :width] = visible
        captured.inputs.copy_(host)
        captured.visible.copy_(padded)

    # -- Entries. ---------------------------------------------------------------------------

    def keep(self, start: int, path: list[int]) -> None:
        """Keep entries ``start + path[i]`` at ``start + i`` (a commit; ``engine.kv.keep_path``)."""
        moved = [i for i, node in enumerate(path) if node != i]
        if moved:
            source = torch.tensor([start + path[i] for i in moved], device=self.device)
            target = torch.tensor([start + i for i in moved], device=self.device)
            self.keys[:, :, target] = self.keys[:, :, source]
            self.values[:, :, target] = self.values[:, :, source]

    def save(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> each [L, H, stop - start, D]
        """A copy of entries ``start .. stop-1``."""
        return self.keys[:, :, start:stop].clone(), self.values[:, :, start:stop].clone()

    def put(self, start: int, saved: tuple[torch.Tensor, torch.Tensor], rows: list[int] | None = None) -> int:
        """Write saved entries (only ``rows`` of them, in that order, if given) from slot ``start``;
        returns how many were written."""
        keys, values = saved
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            keys, values = keys.index_select(2, index), values.index_select(2, index)
        count = keys.shape[2]
        self.keys[:, :, start:start + count] = keys
        self.values[:, :, start:start + count] = values
        return count
