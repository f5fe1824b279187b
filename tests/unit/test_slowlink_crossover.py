"""The bench's crossover at a common loss: measured from a run's records, and the planner's
from the same inputs (meshtrain/bench/slowlink_crossover.py)."""
import math

import pytest

from meshtrain.bench import slowlink_crossover as xover
from meshtrain.core.plan import Plan
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.time_model import step_time


def test_reach_sums_the_records_up_to_the_first_evaluation_at_the_target():
    row = {"evals": [(0, 0.0, 5.0), (2, 3.0, 3.0), (4, 7.0, 2.5)],
           "records": [(1.0, 10), (1.0, 10), (1.5, 20), (1.5, 20)]}
    assert xover.reach(row, 3.0) == (2, 3.0, 2.0, 20)
    assert xover.reach(row, 2.6) == (4, 7.0, 5.0, 60)
    assert xover.reach(row, 2.0) is None


def test_measured_crossover_equalises_time_to_the_target():
    ddp, method = (100, 0.0, 50.0, 8e9), (160, 0.0, 60.0, 1e9)
    bw = xover.measured_crossover(ddp, method)
    assert 50.0 + 8e9 / bw == pytest.approx(60.0 + 1e9 / bw)
    assert xover.measured_crossover(ddp, (160, 0.0, 40.0, 1e9)) == math.inf
    assert xover.measured_crossover(ddp, (160, 0.0, 60.0, 9e9)) == 0.0


def test_planner_crossover_is_anchored_on_each_measured_step():
    nproc, batch, bw, lat, measured, measured_dil = 4, 16, 1.25e8, 5e-3, 0.4, 0.35
    plan = xover.plan_of(["--dp-mode", "diloco", "--sync-every", "8"], nproc)
    assert plan == Plan(dp=4, dp_mode="diloco", sync_every=8)
    gain = 1.3
    got = xover.planner_crossover("tiny", nproc, batch, bw, lat, measured, measured_dil, plan,
                                  gain)
    spec = preset("tiny")
    setup = Setup(global_batch=batch, micro_batch=4, precision="fp32", optimizer="adam",
                  recompute="none")
    free = Cluster(nodes=4, gpus_per_node=1, inter_bw=bw, inter_latency=lat,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0)
    ddp, dil = Candidate(Plan(dp=4), 4), Candidate(plan, 4)
    link = step_time(spec, ddp, setup, free).total
    # DDP's link time at 1 Gb/s, 5 ms: one bucket, 6 ring steps of latency, 1.5x the bytes
    # (the gradients and the statistics that ride with them)
    assert link == pytest.approx(6 * lat + 1.5 * spec.num_params * 4 / bw, rel=1e-4)
    cluster = free.with_(step_overhead=measured - link)
    assert step_time(spec, ddp, setup, cluster).total == pytest.approx(measured)
    mine = free.with_(step_overhead=measured_dil - step_time(spec, dil, setup, free).total)
    assert step_time(spec, dil, setup, mine).total == pytest.approx(measured_dil)
    at = lambda c, cl: step_time(spec, c, setup, cl.with_(inter_bw=got)).total
    assert at(ddp, cluster) == pytest.approx(gain * at(dil, mine), rel=1e-6)
    powersgd = xover.plan_of(["--compression", "powersgd", "--compression-rank", "4"], nproc)
    assert xover.planner_crossover("tiny", nproc, batch, bw, lat, measured, measured_dil,
                                   powersgd, gain) is None
