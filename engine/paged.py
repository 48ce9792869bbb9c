"""A paged KV pool and one packed forward over many requests' trees.

The pool holds every request's keys and values in fixed-size blocks; a request's block table
maps its token index i to slot ``blocks[i // block_size] * block_size + i % block_size``. A
forward packs the new tokens of many requests into one sequence ``[1, T]``; a custom attention
function registered with transformers (``specinfer_paged``) writes their keys/values into the pool
and lets each request's tokens attend to its own slots only, under its own tree mask.

Each sequence keeps ``length`` committed entries, then ``pending`` speculative ones (tree nodes
in the order they were written). ``keep(path)`` moves the accepted path's few entries in place
after the committed ones and frees the blocks past the new end: the prefix is never copied.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .tree import attention_bias

ATTENTION = "specinfer_paged"


class PoolExhausted(RuntimeError):
    """The pool has no free block for a request (admission should have prevented this)."""


class BlockPool:
    """Keys and values of every layer for ``num_blocks * block_size`` token slots."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        slots = num_blocks * block_size
        self.block_size, self.num_blocks = block_size, num_blocks
        self.keys = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]  # each [slots, H, D]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reserved = 0
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model, tokens: int, block_size: int = 16) -> "BlockPool":
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        return cls(config.num_hidden_layers, heads, head_dim, -(-tokens // block_size), block_size, dtype,
                   next(model.parameters()).device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def counts(self) -> tuple[int, int, int]:
        """(free, unreserved, total) blocks."""
        return self.num_free, self.num_unreserved, self.num_blocks

    @property
    def num_unreserved(self) -> int:
        """Free blocks that no admitted request has been promised."""
        return len(self._free) - self._reserved

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def reserve(self, blocks: int) -> bool:
        """Promise ``blocks`` to one request (admission); False when the pool cannot."""
        with self._lock:
            if blocks > len(self._free) - self._reserved:
                return False
            self._reserved += blocks
            return True

    def allocate(self, count: int, from_reserve: int) -> list[int]:
        """``count`` blocks, ``from_reserve`` of them out of the caller's reservation."""
        with self._lock:
            if count - from_reserve > len(self._free) - self._reserved:
                raise PoolExhausted(f"KV pool exhausted: {count} blocks wanted, {self.num_unreserved} unreserved")
            self._reserved -= from_reserve
            return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int], to_reserve: int = 0) -> None:
        """Return ``blocks``; ``to_reserve`` (may be negative) moves the owner's reservation."""
        with self._lock:
            self._free.extend(reversed(blocks))
            self._reserved += to_reserve


class PagedSequence:
    """One request's block table in a pool: ``length`` committed entries, then ``pending`` speculative.

    ``quota``: blocks reserved at admission. Blocks the sequence holds count against it; the rest
    stays reserved in the pool, so a block freed by a truncation is reserved for it again.
    """

    def __init__(self, pool: BlockPool, reserve_tokens: int = 0):
        self.pool, self.blocks, self.length, self.pending = pool, [], 0, 0
        self.quota = pool.blocks_for(reserve_tokens)
        if self.quota and not pool.reserve(self.quota):
            raise PoolExhausted(f"KV pool cannot hold {reserve_tokens} more tokens")

    @property
    def reserved(self) -> int:
        """Blocks still promised to this sequence and not yet taken."""
        return max(0, self.quota - len(self.blocks))

    def slots(self, start: int, stop: int) -> torch.Tensor:  # -> [stop - start]
        """Pool slots of entries ``start..stop-1``. Example: blocks [7, 2], block size 4,
        entries 3..5 -> slots [31, 8, 9]."""
        index = torch.arange(start, stop)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[index // self.pool.block_size] * self.pool.block_size + index % self.pool.block_size

    def append(self, count: int) -> torch.Tensor:  # -> [count] slots of the new speculative entries
        end = self.length + self.pending
        missing = self.pool.blocks_for(end + count) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing, min(missing, self.reserved))
        self.pending += count
        return self.slots(end, end + count)

    def keep(self, path: list[int]) -> None:
        """Commit the pending entries on ``path`` (indices into the pending ones), drop the rest.

        Example: length 10, pending 5, path [0, 3, 4] -> entries 10, 13, 14 move to 10, 11, 12;
        length 13, pending 0; blocks past entry 13 go back to the pool.
        """
        moved = [i for i, node in enumerate(path) if node != i]
        if moved:
            source = self.slots(self.length + moved[0], self.length + self.pending)[
                torch.tensor(path[moved[0]:]) - moved[0]]
            target = self.slots(self.length + moved[0], self.length + len(path))
            source, target = source.to(self.pool.keys[0].device), target.to(self.pool.keys[0].device)
            for keys, values in zip(self.pool.keys, self.pool.values):
                keys[target] = keys[source]
                values[target] = values[source]
        self.length += len(path)
        self.pending = 0
        self.truncate(self.length)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries (all committed); free the blocks past them."""
        self.length, self.pending = min(self.length, length), 0
        self._shrink_to(self.pool.blocks_for(self.length))

    def release(self) -> None:
        """Give every block and the unused reservation back (idempotent)."""
        self._shrink_to(0)
        self.pool.free([], to_reserve=-self.reserved)
        self.quota = self.length = self.pending = 0

    def _shrink_to(self, keep: int) -> None:
        if len(self.blocks) > keep:
            before = self.reserved
            freed, self.blocks = self.blocks[keep:], self.blocks[:keep]
            self.pool.free(freed, to_reserve=self.reserved - before)


@dataclass(frozen=True)
class ForwardItem:
    """New tokens of one sequence for a packed forward.

    tokens:    # [n] int64
    positions: # [n] int64 rotary positions
    visible:   # [n, K] bool over the sequence's speculative entries after these n are
               #   appended (K = pending + n); committed entries are always visible
    rows:      # [r] int64, which of the n tokens need logits
    """

    sequence: PagedSequence
    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    visible: torch.Tensor  # [n, K]
    rows: torch.Tensor  # [r]


@dataclass(frozen=True)
class _Segment:
    start: int
    stop: int
    read_slots: torch.Tensor  # [C]
    bias: torch.Tensor  # [1, 1, n, C]


@dataclass(frozen=True)
class PackedBatch:
    """What the attention function needs: the pool, where new entries go, who reads what."""

    pool: BlockPool
    write_slots: torch.Tensor  # [T]
    segments: tuple[_Segment, ...]


def chain_item(sequence: PagedSequence, tokens: list[int], last_only: bool = True) -> ForwardItem:
    """Committed tokens fed in order (prefill, catching up): causal over themselves."""
    n, start = len(tokens), sequence.length + sequence.pending
    visible = torch.ones(n, sequence.pending + n, dtype=torch.bool)
    visible[:, sequence.pending:] = torch.ones(n, n, dtype=torch.bool).tril()
    rows = torch.tensor([n - 1]) if last_only else torch.arange(n)
    return ForwardItem(sequence, torch.tensor(tokens, dtype=torch.long), torch.arange(start, start + n), visible, rows)


class PagedModel:
    """A Hugging Face causal LM running packed forwards over a BlockPool."""

    def __init__(self, model, pool: BlockPool):
        register_attention()
        model.set_attn_implementation(ATTENTION)
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:  # -> per item [r, V] float32
        batch, rows = self._pack(items)
        ids = torch.cat([item.tokens for item in items])[None].to(self.device)
        positions = torch.cat([item.positions for item in items])[None].to(self.device)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, paged=batch,
                         logits_to_keep=rows.to(self.device))
        logits = out.logits[0].float()  # [R, V]
        return list(torch.split(logits, [len(item.rows) for item in items]))

    def _pack(self, items: list[ForwardItem]) -> tuple[PackedBatch, torch.Tensor]:
        writes, segments, rows, offset = [], [], [], 0
        dtype = self.pool.keys[0].dtype
        for item in items:
            n, sequence = len(item.tokens), item.sequence
            writes.append(sequence.append(n))
            read = sequence.slots(0, sequence.length + sequence.pending)
            bias = attention_bias(item.visible, sequence.length, dtype)  # [1, 1, n, C]
            segments.append(_Segment(offset, offset + n, read.to(self.device), bias.to(self.device)))
            rows.append(item.rows + offset)
            offset += n
        return PackedBatch(self.pool, torch.cat(writes).to(self.device), tuple(segments)), torch.cat(rows)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged=None, **kwargs):
    """query [1, Hq, T, D], key/value [1, H, T, D] -> ([1, T, Hq, D], None).

    Without a PackedBatch it is plain SDPA, so a model set to this attention still runs the
    DynamicCache path. With one, the new keys/values go to their slots, then each request's
    queries attend to its own slots under its own mask.
    """
    if paged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    keys, values = paged.pool.keys[module.layer_idx], paged.pool.values[module.layer_idx]
    keys[paged.write_slots] = key[0].transpose(0, 1).to(keys.dtype)
    values[paged.write_slots] = value[0].transpose(0, 1).to(values.dtype)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, Hq, D]
    for segment in paged.segments:
        k = keys[segment.read_slots].transpose(0, 1)[None].to(query.dtype)  # [1, H, C, D]
        v = values[segment.read_slots].transpose(0, 1)[None].to(query.dtype)
        o = F.scaled_dot_product_attention(query[:, :, segment.start:segment.stop], k, v,
                                           attn_mask=segment.bias.to(query.dtype), scale=scaling, enable_gqa=True)
        out[segment.start:segment.stop] = o[0].transpose(0, 1)
    return out[None], None


_registered = False


def register_attention() -> None:
    """Register ``specinfer_paged`` with transformers (its mask builder is SDPA's)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION, paged_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        _registered = True
