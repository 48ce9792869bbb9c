"""Per-request call guarding in an actor whose request calls run on concurrent threads.

An actor runs each request's call on its own thread (``max_concurrency``); with batching their
forwards are packed into one. A request's paged KV blocks must not go back to the pool while a
call of that request is still writing into them, so every state carries a lock: a call holds
it, and dropping the state (release, TTL sweep) takes it, marks the state dropped and frees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable


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
