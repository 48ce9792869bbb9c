"""A paged KV pool: block accounting with a block table per request, and the K/V storage.

The two halves live apart so that they can live in different processes: the accounting
(``BlockPool``: free list, reservations; ``PagedSequence``: one request's block table) is kept
where requests are scheduled, the storage (``KVStorage``: every layer's keys and values per slot)
where the model runs; under tensor parallelism each rank holds its shard of the storage (its
own key/value heads) and the coordinator holds the one accounting.

A request's block table maps its token index i to slot ``blocks[i // block_size] * block_size +
i % block_size``. Each sequence keeps ``length`` committed entries, then ``pending`` speculative
ones (tree nodes in the order they were written). ``keep(path)`` commits the accepted path: it
records the few moves (source slot -> target slot) that put the path's entries after the committed
ones, and frees the blocks past the new end; the storage applies recorded moves at the start of
the next packed forward, before anything is written. The prefix is never copied.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .kv import activation_dtype


class PoolExhausted(RuntimeError):
    """The pool has no free block for a request (admission should have prevented this)."""


class StateLost(RuntimeError):
    """A request's state is gone though it was never released: its KV entries (the storage behind
    its pool restarted) or its actor's state (the actor restarted)."""


class BlockPool:
    """Accounting of ``num_blocks`` blocks of ``block_size`` token slots: free list, reservations,
    moves recorded by commits, and the storage epoch.

    ``epoch`` counts storage losses (a tensor-parallel group restarted): sequences of an older
    epoch keep their blocks until released, but their entries are gone.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.epoch = 0
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reserved = 0
        self._moves: list[torch.Tensor] = []  # each [2, w]: source slots, target slots
        self._lock = threading.Lock()

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int = 16) -> "BlockPool":
        return cls(-(-tokens // block_size), block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

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

    def record_moves(self, source: torch.Tensor, target: torch.Tensor) -> None:  # each [w] slots
        with self._lock:
            self._moves.append(torch.stack([source, target]))

    def take_moves(self) -> torch.Tensor:  # -> [2, W] source and target slots, in recorded order
        """Every move recorded since the last call. Take them AFTER allocating a forward's blocks:
        a block freed later cannot have been handed to that forward, so its sources are intact."""
        with self._lock:
            moves, self._moves = self._moves, []
        return torch.cat(moves, dim=1) if moves else torch.empty(2, 0, dtype=torch.long)

    def lose_storage(self) -> None:
        """The storage behind this pool is gone: start a new epoch and drop the recorded moves."""
        with self._lock:
            self.epoch += 1
            self._moves = []


def kv_heads(model_config) -> int:
    """Key/value heads of a model config (grouped-query attention or not)."""
    return getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads


def head_dim(model_config) -> int:
    """Width of one attention head (its own setting, or hidden size over heads)."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def heads_per_shard(model_config, shards: int) -> int:
    """Key/value heads each of ``shards`` tensor-parallel ranks holds (whole heads only)."""
    heads = kv_heads(model_config)
    if heads % shards:
        raise ValueError(f"{heads} key/value heads cannot be split evenly over {shards} tensor-parallel ranks")
    return heads // shards


class KVStorage:
    """Keys and values of every layer for a pool's slots (``kv_heads``: this process's heads), head
    first: a request's entries gathered along the slots (``index_select(1, slots)``) come out as
    ``[H, C, D]``, the layout attention multiplies, in one copy."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.keys = [torch.zeros(kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]  # each [H, slots, D]

    @classmethod
    def for_model(cls, model, slots: int, shards: int = 1) -> "KVStorage":
        """Storage for ``model``; with ``shards`` tensor-parallel ranks, one rank's share of the heads."""
        config = model.config
        dtype = activation_dtype(model)
        return cls(config.num_hidden_layers, heads_per_shard(config, shards), head_dim(config), slots, dtype,
                   next(model.parameters()).device)

    def move(self, moves: torch.Tensor) -> None:  # moves: [2, W] source, target slots
        """Copy entries from source to target slots in every layer, in order."""
        if moves.shape[1] == 0:
            return
        source, target = moves.to(self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            keys[:, target] = keys[:, source]
            values[:, target] = values[:, source]


def block_slots(blocks, block_size: int, start: int, stop: int) -> torch.Tensor:  # -> [stop - start]
    """Pool slots of entries ``start..stop-1`` of a block table. Example: blocks [7, 2], block size
    4, entries 3..5 -> slots [31, 8, 9]."""
    index = torch.arange(start, stop)
    return torch.tensor(blocks, dtype=torch.long)[index // block_size] * block_size + index % block_size


@dataclass(frozen=True)
class SavedEntries:
    """Copies of ``count`` of a sequence's entries, in order from the first slot of ``blocks``:
    blocks of their own, out of the pool's unreserved ones (``PagedSequence.save``); they go back
    with ``PagedSequence.restore`` or ``drop``."""

    blocks: tuple[int, ...]
    count: int

    def slots(self, block_size: int) -> torch.Tensor:  # -> [count]
        return block_slots(self.blocks, block_size, 0, self.count)


class PagedSequence:
    """One request's block table in a pool: ``length`` committed entries, then ``pending`` speculative.

    ``quota``: blocks reserved at admission. Blocks the sequence holds count against it; the rest
    stays reserved in the pool, so a block freed by a truncation is reserved for it again.
    ``epoch``: the pool's storage epoch when the sequence was made (its entries exist while equal).
    """

    def __init__(self, pool: BlockPool, reserve_tokens: int = 0):
        self.pool, self.blocks, self.length, self.pending = pool, [], 0, 0
        self._pending_positions: list[torch.Tensor] = []  # each [n]: positions of an append's entries
        self.epoch = pool.epoch
        self.quota = pool.blocks_for(reserve_tokens)
        if self.quota and not pool.reserve(self.quota):
            raise PoolExhausted(f"KV pool cannot hold {reserve_tokens} more tokens")

    @property
    def reserved(self) -> int:
        """Blocks still promised to this sequence and not yet taken."""
        return max(0, self.quota - len(self.blocks))

    @property
    def lost(self) -> bool:
        """Its storage was lost (its entries are gone); it can only be released."""
        return self.epoch != self.pool.epoch

    def slots(self, start: int, stop: int) -> torch.Tensor:  # -> [stop - start]
        """Pool slots of entries ``start..stop-1`` (``block_slots``)."""
        return block_slots(self.blocks, self.pool.block_size, start, stop)

    def append(self, count: int, positions: torch.Tensor | None = None) -> torch.Tensor:  # -> [count] slots
        """Room for ``count`` new speculative entries at ``positions`` ([count]; None: right after the
        others, as a chain); the slots they go to."""
        end = self.length + self.pending
        missing = self.pool.blocks_for(end + count) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing, min(missing, self.reserved))
        self.pending += count
        self._pending_positions.append(torch.arange(end, end + count) if positions is None else positions)
        return self.slots(end, end + count)

    def pending_positions(self) -> torch.Tensor:  # -> [pending] int64
        """The positions of the speculative entries, in order (a committed entry's position is its
        index: a commit keeps a path from the root, whose positions run on from the prefix)."""
        return torch.cat(self._pending_positions) if self._pending_positions else torch.empty(0, dtype=torch.long)

    def keep(self, path: list[int]) -> None:
        """Commit the pending entries on ``path`` (indices into the pending ones), drop the rest.

        Example: length 10, pending 5, path [0, 3, 4] -> entries 13, 14 move to 11, 12 (recorded
        for the storage); length 13, pending 0; blocks past entry 13 go back to the pool.
        """
        moved = [i for i, node in enumerate(path) if node != i]
        if moved and not self.lost:  # recorded before the blocks are freed (see take_moves)
            source = self.slots(self.length + moved[0], self.length + self.pending)[
                torch.tensor(path[moved[0]:]) - moved[0]]
            self.pool.record_moves(source, self.slots(self.length + moved[0], self.length + len(path)))
        self.length += len(path)
        self.pending = 0
        self.truncate(self.length)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries (all committed); free the blocks past them."""
        self.length, self.pending = min(self.length, length), 0
        self._pending_positions = []
        self._shrink_to(self.pool.blocks_for(self.length))

    def save(self, start: int) -> SavedEntries:
        """Copy the committed entries ``start..length-1`` into blocks of their own (the copy is a
        recorded move, applied before the next forward writes anything, so the entries may be
        truncated at once). PoolExhausted when no unreserved block is free: nothing changed then.
        Example: blocks [7, 2], block size 4, length 6, start 3 -> slots [31, 8, 9] copied to the
        first 3 slots of a new block."""
        count = self.length - start
        saved = SavedEntries(tuple(self.pool.allocate(self.pool.blocks_for(count), 0)), count)
        self.pool.record_moves(self.slots(start, self.length), saved.slots(self.pool.block_size))
        return saved

    def restore(self, start: int, saved: SavedEntries) -> None:
        """Keep the first ``start`` entries, then the saved ones as committed entries (copied back by
        a recorded move); the saved blocks go back to the pool."""
        self.truncate(start)
        target = self.append(saved.count)
        self.keep(list(range(saved.count)))
        self.pool.record_moves(saved.slots(self.pool.block_size), target)
        self.pool.free(list(saved.blocks))

    def drop(self, saved: SavedEntries) -> None:
        """Give the blocks of entries saved but not restored back to the pool."""
        self.pool.free(list(saved.blocks))

    def release(self) -> None:
        """Give every block and the unused reservation back (idempotent)."""
        self._shrink_to(0)
        self.pool.free([], to_reserve=-self.reserved)
        self.quota = self.length = self.pending = 0
        self._pending_positions = []

    def _shrink_to(self, keep: int) -> None:
        if len(self.blocks) > keep:
            before = self.reserved
            freed, self.blocks = self.blocks[keep:], self.blocks[:keep]
            self.pool.free(freed, to_reserve=self.reserved - before)
