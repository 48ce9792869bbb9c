"""Measured times: running estimates (the SSM's level forwards, the target's prompt tokens) and
the median of repeated runs (cost curves, benchmarks)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

KEEP = 0.8  # weight of the estimate so far; a new measurement gets 1 - KEEP


def moving_average(last: float | None, value: float, keep: float = KEEP) -> float:
    """Fold ``value`` into the estimate ``last`` (None: nothing measured yet, the value itself), the
    estimate weighted ``keep``.

    Example: None, 30 -> 30; 30, 40 -> 32 (0.8 x 30 + 0.2 x 40); keep 0.5: 30, 40 -> 35.
    """
    return value if last is None else keep * last + (1.0 - keep) * value


def median_ms(run: Callable[[], object], repeats: int) -> float:
    """Median ms of ``repeats`` calls of ``run`` after one unrecorded warm-up call."""
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times[1:])
