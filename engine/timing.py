"""Running estimates of measured times (the SSM's level forwards, the target's prompt tokens)."""

from __future__ import annotations

KEEP = 0.8  # weight of the estimate so far; a new measurement gets 1 - KEEP


def moving_average(last: float | None, value: float) -> float:
    """Fold ``value`` into the estimate ``last`` (None: nothing measured yet, the value itself).

    Example: None, 30 -> 30; 30, 40 -> 32 (0.8 x 30 + 0.2 x 40).
    """
    return value if last is None else KEEP * last + (1.0 - KEEP) * value
