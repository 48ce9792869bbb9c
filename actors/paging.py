"""Paged, batched models inside an actor: pool + batcher, and per-request state guarding.

An actor runs each request's call on its own thread (``max_concurrency``); with batching their
forwards are packed into one. A request's paged KV blocks must not go back to the pool while a
call of that request is still writing into them, so every state carries a lock: a call holds
it, and dropping the state (release, TTL sweep) takes it, marks the state dropped and frees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from settings.config import EngineConfig
from engine.batched import paged_parts
from engine.batching import ForwardBatcher
from engine.paged import BlockPool


@dataclass
class Guard:
    """One request's call lock and whether the state was dropped (its calls then answer None)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    dropped: bool = False


def make_dropper(release: Callable[[object], None]) -> Callable[[object], None]:
    """``on_drop`` for a RequestStore whose states have a ``guard``: ``release(state)`` runs once no
    call of that request is in flight, and later calls of it answer None."""

    def drop(state) -> None:
        with state.guard.lock:  # waits for a call in flight on this request
            state.guard.dropped = True
            release(state)

    return drop


def batching_parts(config: EngineConfig, model, expected: Callable[[], int],
                   scale: float = 1.0) -> tuple[BlockPool, ForwardBatcher]:
    """The pool (``kv_cache_tokens`` x ``scale`` token slots) and batcher for one model."""
    batching = config.server.batching
    return paged_parts(model, int(batching.kv_cache_tokens * scale), batching.block_size,
                       batching.window_ms / 1e3, expected, batching.window_fraction)
