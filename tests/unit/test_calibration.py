"""Calibration's arithmetic: ranks combine to the slowest, rounds to their mean; timing with
and without waiting for every rank."""
import time

import pytest

from meshtrain.bench.timing import time_each_step
from meshtrain.planner.calibrate import _combine, _mean_of_rounds


def _rank(rate: float, busbw: list[float]) -> dict:
    return {"matmul_flops": 2 * rate, "model_flops": rate, "mem_bw": 10 * rate,
            "optimizer_rate": 3 * rate,
            "collectives": {"all_reduce": {"sizes": [256, 1024], "busbw": busbw}}}


def test_a_launch_keeps_the_slowest_rank():
    entry = _combine([_rank(5.0, [1.0, 8.0]), _rank(4.0, [2.0, 6.0])])
    assert entry["model_flops"] == 4.0 and entry["matmul_flops"] == 8.0
    assert entry["mem_bw"] == 40.0 and entry["optimizer_rate"] == 12.0
    # per size, not per rank: the slowest at each size may be a different rank
    assert entry["collectives"]["all_reduce"] == {"sizes": [256, 1024], "busbw": [1.0, 6.0]}


def test_rounds_are_averaged_so_a_slow_phase_is_not_picked_whole():
    fast, slow = _combine([_rank(156.0, [4.0, 10.0])]), _combine([_rank(127.0, [2.0, 6.0])])
    entry = _mean_of_rounds([fast, fast, slow, slow])
    assert entry["model_flops"] == pytest.approx(141.5)
    assert entry["collectives"]["all_reduce"]["busbw"] == pytest.approx([3.0, 8.0])
    assert entry["per_round"]["model_flops"] == [156.0, 156.0, 127.0, 127.0]


def test_timing_counts_the_trailing_barrier_only_when_waiting_for_all():
    calls = []

    def sync():
        calls.append("sync")
        time.sleep(0.05)

    def step():
        calls.append("step")

    waited = time_each_step(step, 2, sync, wait_for_all=True)
    assert calls == ["sync", "step", "sync"] * 2
    assert min(waited) >= 0.05          # the slowest rank's finish is part of the step
    calls.clear()
    alone = time_each_step(step, 2, sync, wait_for_all=False)
    assert calls == ["sync", "step"] * 2
    assert max(alone) < 0.05
