"""Fair timing on a shared, noisy machine: alternate the contenders, repeat, take medians.

Each contender is a `step()` callable; `alternate` runs warm-up steps, then for every
repetition times `steps` steps of each contender in turn (A, B, A, B, ...), so slow phases
of the machine hit both sides alike. Times are per step, in seconds.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def time_steps(step: Callable[[], object], steps: int, sync: Callable[[], None]) -> float:
    """Mean seconds per step over `steps` steps, the ranks lined up before and after."""
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def alternate(contenders: dict[str, Callable[[], object]], steps: int, reps: int, warmup: int,
              sync: Callable[[], None]) -> dict[str, list[float]]:
    """Per-repetition seconds per step of each contender, measured in alternation."""
    for step in contenders.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, step in contenders.items():
            times[name].append(time_steps(step, steps, sync))
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)
