"""Timing the benches' figures: medians, and pairs run back to back."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """The median of ``repeats`` runs of ``fn`` (each returns its own seconds)."""
    return statistics.median(fn() for _ in range(repeats))


def paired(
    ours: Callable[[], float], floor: Callable[[], float], ours_first: bool
) -> tuple[float, float]:
    """(ours, floor), run back to back in the given order."""
    if ours_first:
        a = ours()
        return a, floor()
    b = floor()
    return ours(), b


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
