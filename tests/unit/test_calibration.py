"""Calibration's arithmetic: ranks combine to the slowest, rounds to their mean; timing with
and without waiting for every rank."""
import time

import pytest

from meshtrain.bench.timing import time_each_step
from meshtrain.planner.calibrate import _combine, _mean_of_rounds


def _rank(rate: float, busbw: list[float]) -> dict:
    return {"matmul_flops": 2 * rate, "model_flops": rate, "model_flops_small": rate / 2,
            "mem_bw": 10 * rate,
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


def test_runtime_memory_is_a_line_through_the_median_points():
    from meshtrain.planner.calibrate import fit_runtime_memory
    MB = 1e6
    # three rounds of (activations, overhead) at two batch sizes; one round's heap grew more
    rounds = [[(10 * MB, 6 * MB), (40 * MB, 24 * MB)],
              [(10 * MB, 7 * MB), (40 * MB, 27 * MB)],
              [(10 * MB, 9 * MB), (40 * MB, 22 * MB)]]
    fit = fit_runtime_memory(rounds)
    # medians (10, 7) and (40, 24): slope 17/30, intercept 7 - 10 * 17/30
    assert fit["per_activation_byte"] == pytest.approx(17 / 30)
    assert fit["fixed"] == pytest.approx(7 * MB - 10 * MB * 17 / 30)
    assert fit["per_round"] == [[6 * MB, 24 * MB], [7 * MB, 27 * MB], [9 * MB, 22 * MB]]
    # memory never shrinks as activations grow: a falling line is clamped to flat
    flat = fit_runtime_memory([[(10 * MB, 8 * MB), (40 * MB, 5 * MB)]])
    assert flat["per_activation_byte"] == 0.0 and flat["fixed"] == 8 * MB


def test_the_trainer_correction_meets_both_measured_ddp_steps():
    from meshtrain.planner.calibrate import MEMORY_BATCHES, REFERENCE_GPT, fit_trainer
    from meshtrain.planner.verify import predict

    curve = {"sizes": [256, 2**24], "busbw": [1e7, 1e9]}
    entry = {"matmul_flops": 1e11, "model_flops": 8e10, "model_flops_small": 7e10,
             "mem_bw": 1e10, "optimizer_rate": 1e8,
             "collectives": {k: curve for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                "broadcast", "p2p")},
             "runtime_memory": {"fixed": 1e6, "per_activation_byte": 0.4}}
    profile = {"worlds": {"1": {**entry, "collectives": {}}, "2": entry}, "host_mem": 8e9}
    # the Trainer takes 1.25x the model's compute and 30 ms more a step
    evs = [predict(profile, {"dp": 2}, b, REFERENCE_GPT) for b in MEMORY_BATCHES]
    measured = [ev.time.total + 0.25 * ev.time.compute + 0.03 for ev in evs]
    fit = fit_trainer(profile, 2, [measured, measured])   # two rounds alike
    assert fit["compute_scale"] == pytest.approx(1.25)
    assert fit["per_step"] == pytest.approx(0.03)
    profile["worlds"]["2"]["trainer"] = fit
    for b, m in zip(MEMORY_BATCHES, measured):   # the fitted model meets both points
        assert predict(profile, {"dp": 2}, b, REFERENCE_GPT).time.total == pytest.approx(m, rel=1e-3)
