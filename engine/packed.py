"""One packed forward over many requests' trees, on a paged KV pool (``engine.kv_pool``).

A forward packs the new tokens of many requests into one sequence ``[1, T]`` in two steps that
can run in different processes:

* ``pack(items, pool)`` needs the pool's accounting only: it appends each request's new entries
  to its block table and describes the batch as a ``PackedBatch`` (tokens, positions, the slots
  the new keys/values go to, per request the slots it reads and its tree mask, the rows whose
  logits are kept, and the moves recorded by commits since the last forward). Plain CPU tensors:
  under tensor parallelism this is what the coordinator sends every rank.
* ``PackedRunner.run(batch)`` needs the storage and the model: it applies the moves, then runs
  the model with a custom attention function registered with transformers (``specinfer_paged``)
  that writes the new keys/values into the storage and lets each request's tokens attend to its
  own slots only, under its own tree mask.

``PagedModel`` does both in one process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .kv_pool import BlockPool, KVStorage, PagedSequence, PoolExhausted, StateLost
from .tree import attention_bias

ATTENTION = "specinfer_paged"


@dataclass(frozen=True)
class PromptChunk:
    """A forward item that is a chunk of a prompt: when its prompt began feeding (the batcher's
    ``clock``) and the prompt tokens still to feed, this chunk's included."""

    began: float
    remaining: int


@dataclass(frozen=True)
class ForwardItem:
    """New tokens of one sequence for a packed forward.

    tokens:    # [n] int64
    positions: # [n] int64 rotary positions
    visible:   # [n, K] bool over the sequence's speculative entries after these n are
               #   appended (K = pending + n); committed entries are always visible
    rows:      # [r] int64, which of the n tokens need logits
    prompt:    for a chunk of a prompt (``engine.paged_models.feed``), when that prompt began and
               how much of it is left: prompt chunks count against the batcher's ``chunk_tokens``
               per forward, in the order of ``ForwardBatcher.prompt_order`` (None: not a prompt chunk)
    """

    sequence: PagedSequence
    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    visible: torch.Tensor  # [n, K]
    rows: torch.Tensor  # [r]
    prompt: PromptChunk | None = None


@dataclass(frozen=True)
class Segment:
    """One request's tokens ``start..stop-1`` of the packed sequence and what they read."""

    start: int
    stop: int
    read_slots: torch.Tensor  # [C] its committed entries, then its speculative ones
    committed: int  # the first ``committed`` read slots are visible to every token (but outside a window)
    visible: torch.Tensor  # [n, C - committed] bool
    query_positions: torch.Tensor  # [n] the tokens' positions
    key_positions: torch.Tensor  # [C - committed] the speculative entries' positions (committed entry i: i)


@dataclass(frozen=True)
class PackedBatch:
    """A packed forward, described without the storage or the model (CPU tensors)."""

    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    segments: tuple[Segment, ...]
    rows: torch.Tensor  # [R] rows of the packed sequence whose logits are returned
    row_counts: tuple[int, ...]  # rows per item, in item order
    moves: torch.Tensor  # [2, W] source, target slots to copy before anything is written


class PackedModel(Protocol):
    """What a ForwardBatcher runs: per item ``[r, V]`` logits (or the error of that item alone)."""

    pool: BlockPool

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | BaseException]: ...

    def shutdown(self) -> None:
        """Free what runs the forwards beyond this process (tensor-parallel ranks)."""


def chain_item(sequence: PagedSequence, tokens: list[int], last_only: bool = True,
               prompt: PromptChunk | None = None) -> ForwardItem:
    """Committed tokens fed in order (prefill, catching up): causal over themselves."""
    n, start = len(tokens), sequence.length + sequence.pending
    visible = torch.ones(n, sequence.pending + n, dtype=torch.bool)
    visible[:, sequence.pending:] = torch.ones(n, n, dtype=torch.bool).tril()
    rows = torch.tensor([n - 1]) if last_only else torch.arange(n)
    return ForwardItem(sequence, torch.tensor(tokens, dtype=torch.long), torch.arange(start, start + n), visible, rows,
                       prompt)


def pack(items: list[ForwardItem], pool: BlockPool) -> tuple[PackedBatch | None, list[BaseException | None]]:
    """Append every item's entries to its block table and describe the forward; per item, None or
    the error that leaves it out (its sequence's storage is lost, or the pool has no block for
    it: ``append`` then changed nothing), so one request's failure is its own. No batch: all failed.
    """
    packed, writes, segments, rows, errors, offset = [], [], [], [], [], 0
    for item in items:
        n, sequence = len(item.tokens), item.sequence
        try:
            if sequence.lost:
                raise StateLost("the KV storage was restarted; this request's KV cache is gone")
            writes.append(sequence.append(n, item.positions))
        except (StateLost, PoolExhausted) as error:
            errors.append(error)
            continue
        errors.append(None)
        packed.append(item)
        read = sequence.slots(0, sequence.length + sequence.pending)
        segments.append(Segment(offset, offset + n, read, sequence.length, item.visible, item.positions,
                                sequence.pending_positions()))
        rows.append(item.rows + offset)
        offset += n
    if not packed:
        return None, errors
    moves = pool.take_moves()  # after the allocations: see BlockPool.take_moves
    return PackedBatch(torch.cat([item.tokens for item in packed]), torch.cat([item.positions for item in packed]),
                       torch.cat(writes), tuple(segments), torch.cat(rows), tuple(len(item.rows) for item in packed),
                       moves), errors


def per_item(logits: torch.Tensor | None, batch: PackedBatch | None,
             errors: list[BaseException | None]) -> list[torch.Tensor | BaseException]:  # logits [R, V]
    """Each item's ``[r, V]`` logits, or its own error, in item order (``pack``'s results)."""
    parts = iter(torch.split(logits, batch.row_counts)) if batch is not None else iter(())
    return [next(parts) if error is None else error for error in errors]


@dataclass(frozen=True)
class _Reads:
    start: int
    stop: int
    slots: torch.Tensor  # [C] on the model's device
    segment: Segment
    dtype: torch.dtype
    biases: dict  # sliding window (None: full attention) -> [1, 1, n, C] on the model's device

    def bias(self, window: int | None) -> torch.Tensor:  # -> [1, 1, n, C]
        """The segment's additive mask for a layer with this sliding window (made by the first such layer)."""
        if window not in self.biases:
            s = self.segment
            self.biases[window] = attention_bias(s.visible, s.committed, self.dtype, window, s.query_positions,
                                                 s.key_positions).to(self.slots.device)
        return self.biases[window]


@dataclass(frozen=True)
class PagedContext:
    """What the attention function needs: the storage, where new entries go, who reads what."""

    storage: KVStorage
    write_slots: torch.Tensor  # [T]
    reads: tuple[_Reads, ...]


class PackedRunner:
    """A Hugging Face causal LM running PackedBatches over a KVStorage."""

    def __init__(self, model, storage: KVStorage):
        use_attention(model)
        self.model, self.storage = model, storage
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, batch: PackedBatch) -> torch.Tensor:  # -> [R, V] float32
        self.storage.move(batch.moves)
        dtype, device = self.storage.keys[0].dtype, self.device
        reads = tuple(_Reads(s.start, s.stop, s.read_slots.to(device), s, dtype, {}) for s in batch.segments)
        context = PagedContext(self.storage, batch.write_slots.to(device), reads)
        out = self.model(input_ids=batch.tokens[None].to(device), position_ids=batch.positions[None].to(device),
                         use_cache=False, paged=context, logits_to_keep=batch.rows.to(device))
        return out.logits[0].float()


class PagedModel:
    """Pack and run in one process: the pool's accounting and its storage side by side."""

    def __init__(self, model, pool: BlockPool):
        self.pool = pool
        self.runner = PackedRunner(model, KVStorage.for_model(model, pool.num_slots))

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | BaseException]:  # per item [r, V]
        batch, errors = pack(items, self.pool)
        return per_item(self.runner.run(batch) if batch is not None else None, batch, errors)

    def shutdown(self) -> None:
        """Nothing beyond the model, which the caller owns."""


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged=None,
                    sliding_window=None, softcap=None, **kwargs):
    """query [1, Hq, T, D], key/value [1, H, T, D] -> ([1, T, Hq, D], None).

    Without a PagedContext it is plain SDPA (``unpaged_attention``), so a model set to this attention
    still runs the DynamicCache path. With one, the new keys/values go to their slots, then each
    request's queries attend to its own slots under its own mask, cut to the layer's
    ``sliding_window`` where it has one, with the layer's logit ``softcap`` (gemma2) where it has one.
    """
    if paged is None:
        return unpaged_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                                 softcap, **kwargs)
    keys, values = paged.storage.keys[module.layer_idx], paged.storage.values[module.layer_idx]  # [H, slots, D]
    keys[:, paged.write_slots] = key[0].to(keys.dtype)
    values[:, paged.write_slots] = value[0].to(values.dtype)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, Hq, D]
    for segment in paged.reads:
        k = keys.index_select(1, segment.slots)[None].to(query.dtype)  # [1, H, C, D]
        v = values.index_select(1, segment.slots)[None].to(query.dtype)
        o = attend(query[:, :, segment.start:segment.stop], k, v, segment.bias(sliding_window).to(query.dtype),
                   scaling, softcap)
        out[segment.start:segment.stop] = o[0].transpose(0, 1)
    return out[None], None


# On a CPU, SDPA's reduced-precision kernel is slow for a few queries: over 600 keys (12 query heads,
# 2 KV heads, head size 128, bf16, 2-core AVX512-BF16 EPYC) one query took 621 us against 64 us as
# two matmuls and a float32 softmax (``matmul_attention``); 16 queries 784 against 170 us; from 32
# queries on they are even. In float32 SDPA is as fast. Queries up to this many take the matmuls:
MATMUL_MAX_QUERIES = 16


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
           scaling: float | None, softcap: float | None) -> torch.Tensor:  # -> [B, Hq, n, D]
    """Attention of query [B, Hq, n, D] over key/value [B, H, C, D] (grouped heads) under the additive
    bias [B or 1, 1, n, C]: SDPA, or ``matmul_attention`` with a logit ``softcap`` (which SDPA cannot
    apply) or where it is faster (``matmul_wins``)."""
    if softcap is None and not matmul_wins(query):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=True)
    return matmul_attention(query, key, value, bias, scaling, softcap)


def matmul_wins(query: torch.Tensor) -> bool:  # query [B, Hq, n, D]
    """Whether ``matmul_attention`` beats SDPA here: reduced precision on a CPU, at most
    ``MATMUL_MAX_QUERIES`` queries."""
    return query.device.type == "cpu" and query.dtype != torch.float32 and query.shape[2] <= MATMUL_MAX_QUERIES


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                     scaling: float | None, softcap: float | None) -> torch.Tensor:  # -> [B, Hq, n, D]
    """The eager computation (Gemma 2's with a ``softcap``): scores = query . key * scaling, then
    softcap * tanh(scores / softcap), then the bias, softmax in float32, times the values. Query head
    h reads KV head h // (Hq / H) (Hugging Face's ``repeat_kv`` order): each KV head's queries are
    one matmul, with no copy of the keys per query head."""
    batch, heads, n, size = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * n, size)  # [B, H, Hq / H * n, D]
    scores = (grouped @ key.transpose(2, 3)).view(batch, heads, n, keys)  # [B, Hq, n, C]
    scores = scores * (size ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores + bias, dim=-1, dtype=torch.float32).to(query.dtype)
    out = weights.view(batch, kv_heads, heads // kv_heads * n, keys) @ value  # [B, H, Hq / H * n, D]
    return out.view(batch, heads, n, size)


def unpaged_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                      **kwargs):
    """A forward without a PagedContext (the DynamicCache path): SDPA, or ``matmul_attention`` where
    the layer has a logit softcap, which SDPA cannot apply, or where it is faster (``matmul_wins``).
    Its mask comes from SDPA's builder (registered with the attention): a bool mask, or None where
    the forward is plainly causal."""
    if softcap is None and not matmul_wins(query):
        return _sdpa_attention()(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                 sliding_window=sliding_window, **kwargs)
    queries, keys = query.shape[2], key.shape[2]
    if attention_mask is None:  # causal: the new tokens are the last of the keys
        attention_mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return matmul_attention(query, key, value, attention_mask, scaling, softcap).transpose(1, 2), None


@functools.cache
def _sdpa_attention():
    """transformers' SDPA attention, imported once, on first use (see ``register_custom_attention``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def register_custom_attention(name: str, function) -> None:
    """Register an attention function with transformers under ``name``, with SDPA's mask builder:
    forwards that pass a 4-D mask use it as it is, and the DynamicCache path (no mask passed) gets
    the causal mask it needs. Without a builder transformers would build none, and SDPA's own
    causal flag is wrong for new tokens after cached ones. Registering again replaces the entry.
    (transformers' modeling stack is imported here, not at module import: processes that only pack,
    such as the merge actor and the ingress, do without its ~2 s import.)"""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def use_attention(model) -> None:
    """Register ``specinfer_paged`` with transformers and run ``model`` with it: ``paged_attention``
    in a packed batch, ``unpaged_attention`` (a DynamicCache forward) without one."""
    register_custom_attention(ATTENTION, paged_attention)
    model.set_attn_implementation(ATTENTION)
