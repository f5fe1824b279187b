"""Calibration's arithmetic: ranks combine to the slowest, rounds to their mean; timing with
and without waiting for every rank."""
import pytest

from meshtrain.bench.timing import time_each_step
from meshtrain.measure.probe import combine, mean_of_rounds


def _spec4():
    """The 4-block GPT `meshtrain plan --verify` runs."""
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.measure.verify import MODEL
    return from_gpt_config(GPTConfig(**MODEL))


def _rank(rate: float, busbw: list[float]) -> dict:
    return {"matmul_flops": 2 * rate, "model_flops": rate, "model_flops_small": rate / 2,
            "mem_bw": 10 * rate,
            "optimizer_rate": 3 * rate,
            "collectives": {"all_reduce": {"sizes": [256, 1024], "busbw": busbw}}}


def test_a_launch_keeps_the_slowest_rank():
    entry = combine([_rank(5.0, [1.0, 8.0]), _rank(4.0, [2.0, 6.0])])
    assert entry["model_flops"] == 4.0 and entry["matmul_flops"] == 8.0
    assert entry["mem_bw"] == 40.0 and entry["optimizer_rate"] == 12.0
    # per size, not per rank: the slowest at each size may be a different rank
    assert entry["collectives"]["all_reduce"] == {"sizes": [256, 1024], "busbw": [1.0, 6.0]}


def test_rounds_are_averaged_so_a_slow_phase_is_not_picked_whole():
    fast, slow = combine([_rank(156.0, [4.0, 10.0])]), combine([_rank(127.0, [2.0, 6.0])])
    entry = mean_of_rounds([fast, fast, slow, slow])
    assert entry["model_flops"] == pytest.approx(141.5)
    assert entry["collectives"]["all_reduce"]["busbw"] == pytest.approx([3.0, 8.0])
    assert entry["per_round"]["model_flops"] == [156.0, 156.0, 127.0, 127.0]


class _Clock:
    """A clock that moves only when the test says: the barrier takes 1 s, the step 0.25 s."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def sync(self) -> None:
        self.calls.append("sync")
        self.now += 1.0

    def step(self) -> None:
        self.calls.append("step")
        self.now += 0.25


def test_timing_counts_the_trailing_barrier_only_when_waiting_for_all(monkeypatch):
    from meshtrain.bench import timing

    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    waited = time_each_step(clock.step, 2, clock.sync, wait_for_all=True)
    assert clock.calls == ["sync", "step", "sync"] * 2
    assert waited == [1.25, 1.25]       # the slowest rank's finish is part of the step
    clock.calls.clear()
    alone = time_each_step(clock.step, 2, clock.sync, wait_for_all=False)
    assert clock.calls == ["sync", "step"] * 2
    assert alone == [0.25, 0.25]        # the leading barrier never is


def test_runtime_memory_is_a_line_through_the_median_points():
    from meshtrain.measure.fit import fit_runtime_memory
    MB = 1e6
    # three rounds of ((first layer, rest) traffic, overhead) at two batch sizes; one
    # round's heap grew more
    a, b = (4 * MB, 6 * MB), (16 * MB, 24 * MB)
    rounds = [[(a, 6 * MB), (b, 24 * MB)],
              [(a, 7 * MB), (b, 27 * MB)],
              [(a, 9 * MB), (b, 22 * MB)]]
    fit = fit_runtime_memory(rounds)
    # medians (10, 7) and (40, 24): slope 17/30, intercept 7 - 10 * 17/30
    assert fit["per_activation_byte"] == pytest.approx(17 / 30)
    assert fit["per_first_layer_byte"] == fit["per_activation_byte"]
    assert fit["fixed"] == pytest.approx(7 * MB - 10 * MB * 17 / 30)
    assert fit["per_round"] == [[6 * MB, 24 * MB], [7 * MB, 27 * MB], [9 * MB, 22 * MB]]
    # memory never shrinks as activations grow: a falling line is clamped to flat
    flat = fit_runtime_memory([[(a, 8 * MB), (b, 5 * MB)]])
    assert flat["per_activation_byte"] == 0.0 and flat["fixed"] == 8 * MB


def test_runtime_memory_with_a_deeper_point_separates_the_first_layer():
    """Measured here (1, 2 and 4 blocks): the heap keeps ~0.66 of a micro-batch's first
    layer's traffic and ~0.2 of each further layer's; three points give the three terms."""
    from meshtrain.measure.fit import fit_runtime_memory
    MB = 1e6
    fixed, first, rest = 2 * MB, 0.66, 0.2
    traffic = [(4.6 * MB, 4.7 * MB), (36.8 * MB, 37.4 * MB), (18.4 * MB, 56 * MB)]
    rounds = [[(t, fixed + first * t[0] + rest * t[1] + noise) for t in traffic]
              for noise in (0.0, 1e5, -1e5)]
    fit = fit_runtime_memory(rounds)
    assert "accumulation" not in fit   # no point with several micro-batches
    assert fit["fixed"] == pytest.approx(fixed)
    assert fit["per_first_layer_byte"] == pytest.approx(first)
    assert fit["per_activation_byte"] == pytest.approx(rest)
    # and the line through the first two points, for tensor-parallel ranks
    (f0, r0), (f1, r1) = traffic[:2]
    o0, o1 = (fixed + first * f + rest * r for f, r in traffic[:2])
    slope = (o1 - o0) / (f1 + r1 - f0 - r0)
    assert fit["line"]["per_activation_byte"] == pytest.approx(slope)
    assert fit["line"]["fixed"] == pytest.approx(o0 - slope * (f0 + r0))


def test_accumulation_is_what_two_micro_batches_keep_beyond_one():
    from meshtrain.measure.fit import fit_runtime_memory
    MB = 1e6
    fixed, first, rest = 2 * MB, 0.66, 0.2
    traffic = [(4.6 * MB, 4.7 * MB), (36.8 * MB, 37.4 * MB), (18.4 * MB, 56 * MB),
               (18.4 * MB, 18.7 * MB)]
    overheads = [fixed + first * f + rest * r for f, r in traffic]
    overheads[3] += 8 * MB
    fit = fit_runtime_memory([list(zip(traffic, overheads))])
    assert fit["accumulation"] == pytest.approx(8 * MB)
    assert fit["per_first_layer_byte"] == pytest.approx(first)   # the three single points


def test_runtime_memory_terms_are_never_negative():
    """Points from a real calibration (one process): the deeper point lay a little below what the
    reference points' first-layer rate gives, so the exact terms had the rest's rate at
    -0.03; the fit keeps it at 0 and fits the other two to the three points."""
    from meshtrain.measure.fit import fit_runtime_memory
    MB = 1e6
    points = [((4.2 * MB, 5.0 * MB), 7.1 * MB), ((33.6 * MB, 39.8 * MB), 37.0 * MB),
              ((16.8 * MB, 53.5 * MB), 19.0 * MB)]
    fit = fit_runtime_memory([points])
    assert fit["per_activation_byte"] == 0.0
    assert fit["fixed"] >= 0 and fit["per_first_layer_byte"] > 0.9
    for (f, r), o in points:   # every point within 1 MB (the line misses the deep one by 5)
        assert fixed_plus(fit, f, r) == pytest.approx(o, abs=1 * MB)
    line = fit["line"]
    assert abs(line["fixed"] + line["per_activation_byte"] * (16.8 + 53.5) * MB - 19.0 * MB) > 4 * MB


def fixed_plus(fit: dict, first: float, rest: float) -> float:
    return fit["fixed"] + fit["per_first_layer_byte"] * first + fit["per_activation_byte"] * rest


def test_the_heap_counts_the_first_layer_at_its_own_rate():
    from meshtrain.core.plan import Plan
    from meshtrain.planner import activations as am
    from meshtrain.planner import memory as mm
    from meshtrain.planner.setup import Candidate, Setup
    spec = _spec4()
    cand, setup = Candidate(Plan(), 8), Setup(precision="fp32")
    first, rest = am.forward_traffic(spec, cand, setup, 0)
    assert rest > 3 * first   # three more blocks and the output layer
    base = mm.memory(spec, cand, setup, runtime=(1e6, 0.0, 0.0)).runtime
    assert mm.memory(spec, cand, setup, runtime=(1e6, 0.2, 0.66)).runtime == pytest.approx(
        base + 0.66 * first + 0.2 * rest)
    # two terms: one rate for all traffic, as before
    assert mm.memory(spec, cand, setup, runtime=(1e6, 0.3)).runtime == pytest.approx(
        base + 0.3 * (first + rest))


def test_the_trainer_correction_meets_both_measured_ddp_steps():
    from meshtrain.measure.fit import fit_trainer
    from meshtrain.measure.runs import DEEP_POINT, MEMORY_BATCHES
    from meshtrain.planner.profile import REFERENCE_GPT
    from meshtrain.measure.verify import predict

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
    # with the deeper point too: the nearest terms, here exact again
    del profile["worlds"]["2"]["trainer"]
    layers, batch = DEEP_POINT
    deep = predict(profile, {"dp": 2}, batch, {**REFERENCE_GPT, "n_layer": layers}).time
    three = measured + [deep.total + 0.25 * deep.compute + 0.03]
    fit = fit_trainer(profile, 2, [three, three])
    assert (fit["compute_scale"], fit["per_step"]) == (pytest.approx(1.25), pytest.approx(0.03))
    assert len(fit["points"]) == 3


def test_a_profile_hands_every_fitted_term_to_the_cluster():
    """What `--calibrate` saves reaches the Cluster the planner judges with."""
    from meshtrain.planner.profile import cluster_from_profile
    curve = {"sizes": [256, 2**24], "busbw": [1e7, 1e9]}
    runtime = {"fixed": 5e6, "per_first_layer_byte": 0.9, "per_activation_byte": 0.15,
               "accumulation": 8e6, "line": {"fixed": 4e6, "per_activation_byte": 0.45}}
    fitted = {"zero1": 5.0, "zero2": 5.5, "zero3": 12.0, "zero3r": 4.0, "disk": 1e-8,
              "disk_memory": 4.0, "tp2": 8e-6, "tp2_memory": 9e6, "tp4": 2e-5,
              "tp4_memory": 6e6, "tp2sp_memory": [1e6, 0.3], "pp2": 1e-3,
              "pp2_memory_stages": [9e6, 7e6], "pp2tp2": 0.8,
              "pp2tp2_memory_stages": [7e6, 4e6], "rounds": []}
    entry = {"matmul_flops": 1e11, "model_flops": 8e10, "model_flops_small": 7e10,
             "mem_bw": 1e10, "optimizer_rate": 1e8, "runtime_memory": runtime,
             "trainer": {"compute_scale": 1.05, "per_step": 2e-3},
             "collectives": {k: curve for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                "broadcast", "p2p")}}
    one = {**entry, "collectives": {}, "trainer": {"compute_scale": 0.99, "per_step": 1e-3}}
    profile = {"host_mem": 8e9, "worlds": {"1": one, "4": {**entry, "strategies": fitted}}}
    cl = cluster_from_profile(profile, 4)
    assert cl.runtime == (5e6, 0.15, 0.9, 8e6) and cl.runtime_line == (4e6, 0.45)
    assert cl.process_trainer == (0.99, 1e-3)
    assert cl.tp_overhead == {2: 8e-6, 4: 2e-5} and cl.tp_memory == {2: 9e6, 4: 6e6}
    assert cl.sp_memory == {2: (1e6, 0.3)}
    assert cl.pp_memory == (9e6, 7e6) and cl.pp_tp_memory == (7e6, 4e6)
    assert cl.pp_overhead == 1e-3 and cl.pp_tp_scale == 0.8 and cl.disk_overhead == 1e-8
    assert cl.staging == {1: 5.0, 2: 5.5, 3: 12.0, "3+recompute": 4.0, "disk": 4.0}


def test_a_cpu_calibration_saves_its_kinds_profile_with_the_device_figures(monkeypatch, tmp_path):
    """`calibrate` at one rank, in this process (its launches and the runtime-memory runs,
    other tests' subject, stubbed): the profile names this machine's kind, is saved under
    it, and holds each GEMM's and attention's efficiency and the launch cost."""
    import json
    import os

    import torch

    from meshtrain.measure import calibrate as cal
    from meshtrain.measure.runs import ATTENTION_SHAPES, GEMM_SHAPES
    from meshtrain.planner.calibrated import gemm_flops
    from meshtrain.planner.profile import kind_path

    threads = torch.get_num_threads()   # a rank takes one thread; give the process its own back
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(cal, "launch", lambda fn, nproc, args=(), kwargs=None:
                        [fn(*args, **(kwargs or {}))])
    monkeypatch.setattr(cal, "runtime_memory_point", lambda world, batch, layers, m:
                        ((1e6 * batch, 2e6 * batch * layers), 1e6 + 0.5e6 * batch * m, 0.01 * batch))
    try:
        profile = cal.calibrate((1,), rounds=1, budget_s=0.2, progress=False)
    finally:
        torch.set_num_threads(threads)
    kind = f"cpu-{os.cpu_count()}"
    path = cal.save_calibration(profile)
    assert path == kind_path(kind) and str(path).startswith(str(tmp_path))
    saved = json.loads(path.read_text())
    assert saved["device"] == {"kind": kind, "type": "cpu", "dtype": "fp32", "count": os.cpu_count()}
    entry = saved["worlds"]["1"]
    assert entry["peak_flops"] == entry["matmul_flops"]   # no table entry: the square matmul
    for family, shapes in (("gemm", GEMM_SHAPES["cpu"]), ("attention", ATTENTION_SHAPES["cpu"])):
        curve = entry[family]
        assert curve["shapes"] == [list(s) for s in shapes]
        # measured against the square matmul timed at another moment: no upper bound holds
        # on a machine shared with other work (it read 1.6 under the suite's load)
        assert all(e > 0 for e in curve["efficiency"]), (family, curve)
        assert curve["efficiency"] == pytest.approx([f / entry["peak_flops"] for f in curve["flops"]])
    assert entry["gemm"]["flops_per_call"][0] == gemm_flops(*GEMM_SHAPES["cpu"][0])
    assert 0 < 1 / entry["launch_rate"] < 1e-3, entry["launch_rate"]   # seconds per op: < 1 ms
    # a GPT block's forward and backward dispatch tens of operators
    assert 10 < entry["ops_per_block"] < 500, entry["ops_per_block"]
    assert "launch:" in cal.describe(saved) and "gemm efficiency" in cal.describe(saved)


def test_calibration_on_cuda_runs_one_rank_per_visible_gpu(monkeypatch):
    from meshtrain.measure import calibrate as cal
    assert cal.calibrate_worlds(1, "cpu") == [1, 2]   # --verify needs 2 ranks
    assert cal.calibrate_worlds(8, "cpu") == [1, 2, 4, 8]
    monkeypatch.setattr(cal, "gpu_count", lambda: 1)
    assert cal.calibrate_worlds(4, "cuda") == [1]
    monkeypatch.setattr(cal, "gpu_count", lambda: 8)
    assert cal.calibrate_worlds(4, "cuda") == [1, 2, 4]


def test_small_device_work_is_queued_several_times_between_waits():
    """A GPU's small GEMM or attention is timed over calls that queue about QUEUED_FLOPS (the
    host's launch and wait then hide behind the device's work); a large one, and everything
    on CPU ranks (QUEUED_FLOPS 0), once."""
    from meshtrain.measure.probe import queued_work

    calls = []
    work, flops = queued_work(lambda: calls.append(1), 1e11, 2e12)
    work()
    assert (len(calls), flops) == (20, 2e12)
    once = lambda: None
    assert queued_work(once, 4e12, 2e12) == (once, 4e12)
    assert queued_work(once, 1e6, 0.0) == (once, 1e6)
