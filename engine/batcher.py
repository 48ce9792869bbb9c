"""Continuous batching of forwards: every request thread that is inside a step submits its
forward, and one packed forward runs once every such thread is waiting.

A request thread enters ``participant()`` for a whole draft or verify call. ``submit`` blocks
until its forward has run; the batch runs as soon as every participant is waiting on a
submission (nobody is left who could still add to it), on the thread that completed the set.
Threads that arrive while a batch runs join the next one, so requests join and leave between
forwards and a long request never holds a new one back by more than one forward.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .packed import ForwardItem, PackedModel


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


class ForwardBatcher:
    """``expected()``: how many requests may submit soon (e.g. the running ones); while fewer are
    queued, a batch waits for them up to ``window_s`` or ``window_fraction`` of the last forward's
    time, whichever is longer (calls of one step arrive milliseconds apart: each request's result
    is streamed to its client before its next call). ``chunk_tokens``: the most prompt tokens one
    forward takes, all requests together, in ``prompt_order`` (chunked prefill:
    ``engine.paged_models.feed`` submits prompts in chunks of at most this); None: no limit."""

    def __init__(self, model: PackedModel, window_s: float = 0.0, expected: Callable[[], int] | None = None,
                 window_fraction: float = 0.0, chunk_tokens: int | None = None):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        self.model, self.chunk_tokens = model, chunk_tokens
        self.window_s, self.window_fraction, self.expected = window_s, window_fraction, expected
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
                    self._cond.notify_all()
                self._maybe_lead()

    def submit(self, item: ForwardItem) -> torch.Tensor:  # -> [r, V]
        with self.participant():
            ticket = _Ticket(item)
            with self._cond:
                if not self._queue:
                    self._opened = time.monotonic()
                self._queue.append(ticket)
                self._cond.notify_all()
            while True:
                self._maybe_lead()
                with self._cond:
                    if ticket.done:
                        break
                    self._cond.wait(timeout=max(0.001, min(0.05, self._window())))
                    if ticket.done:
                        break
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _maybe_lead(self) -> None:
        """Run the queued batch on this thread if every participant is waiting."""
        with self._cond:
            if (self._running or not self._queue or len(self._queue) < max(self._active, self._hold)
                    or self._waiting_for_more()):
                return
            (batch, self._queue), self._running, self._hold = self._split(self._queue), True, 0
            self._opened = time.monotonic()  # what is left waits from now
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
        tokens = sum(len(ticket.item.tokens) for ticket in batch)
        if any(ticket.item.prompt is not None for ticket in batch):
            rate = self._last_forward_s / tokens
            self.s_per_token = rate if not self.s_per_token else 0.8 * self.s_per_token + 0.2 * rate

    def _waiting_for_more(self) -> bool:
        if self.expected is None or self._window() <= 0:
            return False
        return len(self._queue) < self.expected() and time.monotonic() - self._opened < self._window()

    def _window(self) -> float:
        return max(self.window_s, self.window_fraction * self._last_forward_s)

    def _count(self, batch: list[_Ticket]) -> None:
        tokens = sum(len(ticket.item.tokens) for ticket in batch)
        c = self.counters
        c.forwards, c.items, c.tokens = c.forwards + 1, c.items + len(batch), c.tokens + tokens
        c.largest = max(c.largest, len(batch))
