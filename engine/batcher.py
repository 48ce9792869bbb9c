"""Continuous batching of forwards: every request thread that is inside a step submits its
forward, and one packed forward runs once every such thread is waiting.

A request thread enters ``participant()`` for a whole draft or verify call. ``submit`` blocks
until its forward has run; the batch runs as soon as every participant is waiting on a
submission (nobody is left who could still add to it), on the thread that completed the set.
Threads that arrive while a batch runs join the next one, so requests join and leave between
forwards and a long request never holds a new one back by more than one forward. Only a thread
still waiting for its own result leads a forward: one whose result is ready returns at once
(had it led the next forward for the others on its way out, its request would lose that
forward's time, as a burst's first tokens did: 1.5 s late at 8 streams).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .packed import ForwardItem, PackedModel
from .timing import moving_average


@dataclass
class _Ticket:
    item: ForwardItem
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass
class BatchCounters:
    """What the batcher did: forwards run, items and tokens in them (for metrics and tests)."""

    forwards: int = 0
    items: int = 0
    tokens: int = 0
    largest: int = 0


@dataclass(frozen=True)
class BatchWaits:
    """How long a packed forward waits for more items before it runs.

    ``window_s`` / ``window_fraction``: while fewer items are queued than ``expected()`` (the running
    requests), up to ``window_s`` or this fraction of the last forward's time, whichever is longer
    (calls of one step arrive milliseconds apart: each request's result is streamed to its client
    before its next call). ``burst_s`` / ``burst_max_s``: while the queue holds only prompt chunks,
    until no other prompt has begun for ``burst_s``, and at most ``burst_max_s`` after the earliest
    began: the rest of a burst arrives (requests sent together reach the actor tens of ms apart,
    spread over up to ~150 ms here), then it goes shortest first (``prompt_order``) instead of
    the first arrival alone. A lone request's first token pays ``burst_s``; running requests never
    wait for it (a queued item that is not a prompt chunk ends it)."""

    window_s: float = 0.0
    window_fraction: float = 0.0
    burst_s: float = 0.0
    burst_max_s: float = 0.0


class ForwardBatcher:
    """``expected()``: how many requests may submit soon (e.g. the running ones); ``waits``: how long
    a forward waits for them and for a burst of prompts (``BatchWaits``). ``chunk_tokens``: the
    most prompt tokens one forward takes, all requests together, in ``prompt_order`` (chunked
    prefill: ``engine.paged_models.feed`` submits prompts in chunks of at most this); None: no
    limit. ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, model: PackedModel, waits: BatchWaits = BatchWaits(), expected: Callable[[], int] | None = None,
                 chunk_tokens: int | None = None, clock: Callable[[], float] = time.monotonic):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        self.model, self.chunk_tokens, self.waits, self.expected, self.clock = model, chunk_tokens, waits, expected, clock
        self._opened, self._last_forward_s = 0.0, 0.0
        self.s_per_token = 0.0  # seconds per token of the forwards with prompt chunks (moving average; 0 before any)
        self.counters = BatchCounters()
        self._cond = threading.Condition()
        self._queue: list[_Ticket] = []
        self._active = 0
        self._running = False
        self._hold = 0
        self._local = threading.local()

    def hold_next(self, count: int) -> None:
        """Make the next batch wait until ``count`` forwards are queued, whatever the timing.

        For tests and benchmarks that must see requests share a forward: the sharing is then
        certain, not a matter of scheduling. The caller must make sure ``count`` forwards come,
        or lift the hold with ``hold_next(0)`` (a count no step reaches freezes every request).
        """
        with self._cond:
            self._hold = count
            self._cond.notify_all()

    @contextmanager
    def participant(self) -> Iterator[None]:
        """Mark this thread as inside a step: batches wait for its next submission or its exit."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            with self._cond:
                self._active += 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()  # a thread waiting on its own forward leads it, never this one

    def submit(self, item: ForwardItem) -> torch.Tensor:  # -> [r, V]
        with self.participant():
            ticket = _Ticket(item)
            with self._cond:
                if not self._queue:
                    self._opened = self.clock()
                self._queue.append(ticket)
                self._cond.notify_all()
            while True:
                self._maybe_lead(ticket)
                with self._cond:
                    if ticket.done:
                        break
                    self._cond.wait(timeout=self._recheck_s())
                    if ticket.done:
                        break
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _maybe_lead(self, own: _Ticket) -> None:
        """Run the queued batch on this thread if every participant is waiting and this thread's own
        ticket ``own`` is still waiting (a thread whose result is ready returns; it never leads)."""
        with self._cond:
            if (own.done or self._running or not self._queue or len(self._queue) < max(self._active, self._hold)
                    or self._waiting_for_more()):
                return
            (batch, self._queue), self._running, self._hold = self._split(self._queue), True, 0
            self._opened = self.clock()  # what is left waits from now
        began = time.monotonic()
        try:
            results = self.model.forward([ticket.item for ticket in batch])
            for ticket, result in zip(batch, results, strict=True):  # an item's own error is its alone
                if isinstance(result, BaseException):
                    ticket.error = result
                else:
                    ticket.result = result
        except BaseException as error:  # every request of the batch sees the failure
            for ticket in batch:
                ticket.error = error
        finally:
            self._last_forward_s = time.monotonic() - began
            self._count(batch)
            self._time_tokens(batch)
            with self._cond:
                for ticket in batch:
                    ticket.done = True
                self._running = False
                self._cond.notify_all()

    def _split(self, queue: list[_Ticket]) -> tuple[list[_Ticket], list[_Ticket]]:
        """(this forward's tickets, those left for the next): prompt chunks in ``prompt_order`` up to
        ``chunk_tokens`` prompt tokens (once one waits, the later ones wait too); the first of them
        always goes, and so does every item that is not a prompt chunk.
        Example: chunk 8, no timing yet; tree 5, prompts begun at t=3 (4 tokens), t=1 (6), t=2 (2)
        -> [5, 6, 2], left [4]."""
        if self.chunk_tokens is None:
            return queue, []
        prompts = sorted((t for t in queue if t.item.prompt is not None), key=lambda t: self.prompt_order(t.item))
        batch, rest, total = [t for t in queue if t.item.prompt is None], [], 0
        for ticket in prompts:
            n = len(ticket.item.tokens)
            if rest or (total and total + n > self.chunk_tokens):
                rest.append(ticket)
                continue
            total += n
            batch.append(ticket)
        return batch, rest

    def prompt_order(self, item: ForwardItem) -> float:
        """A prompt chunk's place in line: when its prompt would have finished, prefilled alone from
        the moment it began (its tokens left at the measured seconds per token), earliest first.
        Prompts that arrive together go shortest first (the burst's median first token comes
        soonest), and a long prompt is never starved: newer prompts' places lie after ``now``.
        Example: 0.01 s per token; begun at t=0 with 300 tokens left -> 3.0; at t=1 with 40 -> 1.4
        (goes first); at t=2.9 with 40 -> 3.3 (goes after the long one)."""
        return item.prompt.began + item.prompt.remaining * self.s_per_token

    def _time_tokens(self, batch: list[_Ticket]) -> None:
        """Fold the last forward's seconds per token into ``s_per_token`` if it prefilled a prompt
        chunk (a decode step's few tokens would count its whole cost against each)."""
        if any(ticket.item.prompt is not None for ticket in batch):
            rate = self._last_forward_s / sum(len(ticket.item.tokens) for ticket in batch)
            self.s_per_token = moving_average(self.s_per_token or None, rate)

    def _waiting_for_more(self) -> bool:
        if self._burst_left() > 0:
            return True
        if self.expected is None or self._window() <= 0:
            return False
        return len(self._queue) < self.expected() and self.clock() - self._opened < self._window()

    def _burst_left(self) -> float:
        """Seconds the queued prompts still wait for the rest of their burst (``BatchWaits``): until
        ``burst_s`` after the latest queued prompt began, at most ``burst_max_s`` after the earliest;
        0 while an item that is not a prompt chunk is queued. Example: burst 0.03, max 0.15, prompts
        begun at 10.00 and 10.02, now 10.03 -> 0.02 (quiet since 10.02: until 10.05)."""
        waits = self.waits
        if waits.burst_s <= 0 or not self._queue or any(t.item.prompt is None for t in self._queue):
            return 0.0
        began = [t.item.prompt.began for t in self._queue]
        until = min(max(began) + waits.burst_s, min(began) + max(waits.burst_s, waits.burst_max_s))
        return max(0.0, until - self.clock())

    def _recheck_s(self) -> float:
        """How long a waiting thread sleeps before it looks again (a wait may have run out)."""
        waits = [w for w in (self._window(), self._burst_left()) if w > 0]
        return max(0.001, min([0.05, *waits]))

    def _window(self) -> float:
        return max(self.waits.window_s, self.waits.window_fraction * self._last_forward_s)

    def _count(self, batch: list[_Ticket]) -> None:
        tokens = sum(len(ticket.item.tokens) for ticket in batch)
        c = self.counters
        c.forwards, c.items, c.tokens = c.forwards + 1, c.items + len(batch), c.tokens + tokens
        c.largest = max(c.largest, len(batch))
