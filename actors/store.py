"""Per-request state kept by an actor: keyed by request id, released explicitly or by TTL."""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, TypeVar

State = TypeVar("State")


class RequestStore(Generic[State]):
    """Thread-safe map request id -> state with idle expiry and release tombstones.

    A released id is remembered (until it expires too) so that a call still in flight when the
    request was cancelled cannot create its state again: ``get_or_create`` returns None then.

    Example: store.get_or_create("r1", make) creates once; store.release("r1") drops it and any
    later get_or_create("r1", make) returns None.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[State], None] | None = None):
        self.ttl_s, self.clock, self.on_drop = ttl_s, clock, on_drop
        self._lock = threading.Lock()
        self._states: dict[str, tuple[State, float]] = {}
        self._released: dict[str, float] = {}

    def get_or_create(self, request_id: str, create: Callable[[], State]) -> State | None:
        with self._lock:
            if request_id in self._released:
                return None
            entry = self._states.get(request_id)
            state = create() if entry is None else entry[0]
            self._states[request_id] = (state, self.clock())
            return state

    def get(self, request_id: str) -> State | None:
        with self._lock:
            entry = self._states.get(request_id)
            if entry is None:
                return None
            self._states[request_id] = (entry[0], self.clock())
            return entry[0]

    def put(self, request_id: str, state: State) -> bool:
        """Store a new state; False (and nothing stored) when the id was already released. A state
        the id already held is dropped (``on_drop``), not leaked."""
        with self._lock:
            if request_id in self._released:
                return False
            old = self._states.get(request_id)
            self._states[request_id] = (state, self.clock())
        if old is not None and old[0] is not state and self.on_drop is not None:
            self.on_drop(old[0])
        return True

    def release(self, request_id: str) -> bool:
        """Drop a request's state; True when there was some."""
        with self._lock:
            self._released[request_id] = self.clock()
            entry = self._states.pop(request_id, None)
        if entry is not None and self.on_drop is not None:
            self.on_drop(entry[0])
        return entry is not None

    def was_released(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._released

    def sweep(self, max_idle_s: float | None = None) -> list[str]:
        """Drop states idle for longer than ``max_idle_s`` (default: the TTL); return their ids."""
        limit = self.ttl_s if max_idle_s is None else max_idle_s
        now = self.clock()
        with self._lock:
            expired = [rid for rid, (_, touched) in self._states.items() if now - touched > limit]
            dropped = [self._states.pop(rid)[0] for rid in expired]
            self._released.update({rid: now for rid in expired})
            self._released = {rid: t for rid, t in self._released.items() if now - t <= self.ttl_s}
        for state in dropped if self.on_drop is not None else ():
            self.on_drop(state)
        return expired

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)


def start_sweeper(store: RequestStore, interval_s: float) -> threading.Event:
    """Sweep ``store`` every ``interval_s`` seconds on a daemon thread; set the event to stop."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            store.sweep()

    threading.Thread(target=loop, name="request-ttl-sweeper", daemon=True).start()
    return stop
