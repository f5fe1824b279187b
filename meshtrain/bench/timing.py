"""Fair timing on a shared, noisy machine: alternate the contenders, repeat, take medians.

Each contender is a `step()` callable. After warm-up, every repetition runs `steps` steps of
each contender in turn, the order flipped every other repetition (A B, B A, ...), so slow
phases of the machine hit both sides alike. Every step is timed on its own, the ranks lined
up before it, and the median over all steps is quoted: one descheduled step moves it little.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def time_each_step(step: Callable[[], object], steps: int, sync: Callable[[], None],
                   wait_for_all: bool = True) -> list[float]:
    """Seconds of each of `steps` steps, the ranks lined up before each; with `wait_for_all`
    a step ends when the slowest rank finishes it (a barrier after it, counted), otherwise
    when this rank does (for timing a collective itself: a trailing barrier would double a
    small one)."""
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        if wait_for_all:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def alternate(contenders: dict[str, Callable[[], object]], steps: int, reps: int, warmup: int,
              sync: Callable[[], None], wait_for_all: bool = True) -> dict[str, list[float]]:
    """Seconds of every timed step of each contender, measured in alternation."""
    for step in contenders.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            times[name] += time_each_step(contenders[name], steps, sync, wait_for_all)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)
