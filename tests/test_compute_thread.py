"""actors.common.ComputeThread: a model actor's torch work on one thread, whichever thread calls."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from actors.common import ComputeThread, on_compute_thread


class Actor:
    """A model actor's shape: loads on its compute thread, serves decorated calls there."""

    def __init__(self):
        self.compute = ComputeThread()
        self.loaded_on = self.compute.run(threading.get_ident)

    @on_compute_thread
    def step(self, value: int) -> tuple[int, int]:
        """(the thread it ran on, value + 1); fails for a negative value."""
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        return threading.get_ident(), value + 1

    def other(self) -> int:
        return threading.get_ident()


def test_calls_from_many_threads_run_on_the_thread_that_loaded():
    actor = Actor()
    with ThreadPoolExecutor(8) as callers:  # as a threaded Ray actor's calls arrive
        results = list(callers.map(actor.step, range(32)))
        plain = set(callers.map(lambda _: actor.other(), range(32)))
    assert {thread for thread, _ in results} == {actor.loaded_on}
    assert [value for _, value in results] == list(range(1, 33))
    assert actor.loaded_on not in plain and threading.get_ident() != actor.loaded_on


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    actor = Actor()
    with pytest.raises(ValueError, match="value must be >= 0, got -1"):
        actor.step(-1)
    assert actor.step(1) == (actor.loaded_on, 2)
    assert Actor.step.__doc__.startswith("(the thread it ran on")  # Ray reads the method as written
