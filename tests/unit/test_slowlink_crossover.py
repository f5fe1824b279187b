"""The bench's crossover at a common loss: measured from a run's records, and the planner's
from the same inputs (meshtrain/bench/slowlink_crossover.py)."""
import json
import math
import random

import pytest

from meshtrain.bench import slowlink, slowlink_crossover as xover
from meshtrain.core.comm import ring_all_reduce_elements, ring_all_reduce_received_elements
from meshtrain.core.link import Link, LinkModel
from meshtrain.core.plan import DDP_FIRST_BUCKET_MB, Plan
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.planner.time_model import step_time
from meshtrain.strategies.shared.buckets import build_buckets


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


def test_the_planners_ddp_link_time_is_the_ring_formula():
    nproc, batch, bw, lat = 4, 16, 1.25e8, 5e-3
    plan = xover.plan_of(["--dp-mode", "diloco", "--sync-every", "8"], nproc)
    assert plan == Plan(dp=4, dp_mode="diloco", sync_every=8)
    spec = preset("tiny")
    setup = Setup(global_batch=batch, micro_batch=4, precision="fp32", optimizer="adam",
                  recompute="none")
    free = Cluster(nodes=4, gpus_per_node=1, inter_bw=bw, inter_latency=lat,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0)
    link = step_time(spec, Candidate(Plan(dp=4), 4), setup, free).total
    # DDP's link time at 1 Gb/s, 5 ms: the tiny GPT's 3.3 MiB of gradients in two buckets
    # (the first closes at 1 MiB, as torch DDP's), 6 ring steps of latency each, 1.5x the
    # bytes (the gradients and the statistics that ride with them)
    assert spec.num_params * 4 > DDP_FIRST_BUCKET_MB * 2**20
    assert link == pytest.approx(2 * 6 * lat + 1.5 * spec.num_params * 4 / bw, rel=1e-4)


def test_reach_interpolates_the_step_the_loss_crosses_the_target_at():
    row = {"evals": [(0, 0.0, 5.0), (2, 3.0, 3.0), (4, 7.0, 2.5)],
           "records": [(1.0, 10), (1.0, 10), (1.5, 20), (1.5, 20)],
           "step_s": [1.0, 2.0, 2.0, 2.0]}
    # linear between (2, 3.0) and (4, 2.5): 2.6 is crossed at step 3.6
    steps, seconds, c, s = xover.reach(row, 2.6, interpolate=True)
    assert steps == pytest.approx(3.6)
    assert seconds == pytest.approx(1.0 + 2.0 + 2.0 + 0.6 * 2.0)
    assert (c, s) == (pytest.approx(2.0 + 1.5 + 0.6 * 1.5), pytest.approx(40 + 0.6 * 20))
    assert xover.reach(row, 3.0, interpolate=True)[:2] == (2, 3.0)   # on an evaluation
    assert xover.reach(row, 2.0, interpolate=True) is None
    assert xover.upto([1.0, 2.0, 4.0], 3) == 7.0 and xover.upto([1.0, 2.0], 1.25) == 1.5


NPROC, BATCH, BW, LAT = 4, 16, 1.25e8, 5e-3


def _free() -> Cluster:
    return Cluster(nodes=NPROC, gpus_per_node=1, inter_bw=BW, inter_latency=LAT,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0)


def _planner_link(plan: Plan) -> tuple[float, float]:
    """(latency seconds, bytes) the planner's time model puts on the dp link per step."""
    setup = Setup(global_batch=BATCH, micro_batch=BATCH // NPROC, precision="fp32",
                  optimizer="adam", recompute="none")
    at = lambda bw: step_time(preset("tiny"), Candidate(plan, BATCH // NPROC), setup,
                              _free().with_(inter_bw=bw)).total
    latency = at(1e30)
    return latency, (at(BW) - latency) * BW


def _write_run(run_dir, link_by_step, reach_at: float, seed: int) -> None:
    """metrics.jsonl and summary.json of a run without training: step i computes for a
    random 0.2-0.3 s and the link charges link_by_step(i) = (latency s, bytes) at BW; the
    validation loss falls linearly from 5.0, through 3.0 at step `reach_at`, every 4 steps."""
    rng, lines = random.Random(seed), []
    for i in range(128):
        lat, nbytes = link_by_step(i)
        link_s = lat + nbytes / BW
        lines.append({"step": i + 1, "step_s": rng.uniform(0.2, 0.3) + link_s,
                      "link_s": link_s, "bytes_sent": nbytes})
        if (i + 1) % 4 == 0:
            lines.append({"step": i + 1, "val_loss": 5.0 - 2.0 * (i + 1) / reach_at})
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (run_dir / "summary.json").write_text(json.dumps(
        {"median_step_s": 0.3, "bytes_sent_per_step": 1.0, "val_loss_end": 3.0}))


@pytest.mark.parametrize("h", [8, 32])
def test_measured_and_planner_crossovers_agree_where_the_link_charges_the_planners_model(
        tmp_path, h):
    """Charges that follow the planner's own link model (DDP's every step, the method's
    K = 32 warm-up steps DDP's too, then one sync of H steps' worth every H steps) and a
    method that reaches the target at a sync: the two crossovers must be one."""
    flags = slowlink.DILOCO + [str(h), "--sync-warmup-steps", "32"]
    ddp_lat, ddp_bytes = _planner_link(Plan(dp=NPROC))
    lat, nbytes = _planner_link(xover.plan_of(flags, NPROC))
    round_link = lambda i: ((ddp_lat, ddp_bytes) if i < 32 else
                            (h * lat, h * nbytes) if (i - 32) % h == h - 1 else (0.0, 0.0))
    _write_run(tmp_path / "ddp", lambda i: (ddp_lat, ddp_bytes), reach_at=70.5, seed=1)
    _write_run(tmp_path / "m", round_link, reach_at=96, seed=2)
    rows = {"ddp": slowlink._row(tmp_path / "ddp", BW), "m": slowlink._row(tmp_path / "m", BW)}
    slowlink._compare(rows, {"ddp": [], "m": flags},
                      dict(model="tiny", nproc=NPROC, batch=BATCH, seq=None, latency=LAT))
    row = rows["m"]
    assert (row["steps_to_target"], row["ddp_steps_to_target"]) == (
        pytest.approx(96), pytest.approx(70.5))
    assert 1e6 < row["crossover_Bps"] < 1e10   # a real crossover, not 0 or inf
    assert row["planner_crossover_Bps"] == pytest.approx(row["crossover_Bps"], rel=1e-6)


def _charged(link: LinkModel, *numels: int) -> None:
    """Charge `link` rank 0's share of one fp32 ring all-reduce over dp per size, as Comm
    accounts it."""
    for numel in numels:
        sent = ring_all_reduce_elements(numel, NPROC, 0) * 4
        received = ring_all_reduce_received_elements(numel, NPROC, 0) * 4
        link.charge("dp", "all_reduce", sent, received, NPROC)


def test_the_planners_link_terms_are_what_the_emulated_link_charges():
    """The emulated link (core/link.py) on a run's dp collectives: DDP's step all-reduces its
    buckets as ddp.py builds them (the first closing at 1 MiB; the last carrying the loss and
    one used flag per parameter tensor); a
    DiLoCo round of H steps all-reduces the sync step's loss, then the pseudo-gradient
    (diloco.py). The planner's latency per step is the link's exactly; its bytes are the
    link's but for the used flags, which it counts at 13 per block (the GPT has 15), and the
    loss scalar's ring share (6 bytes for rank 0's 8)."""
    params = [p for p in GPT(gpt_config("tiny")).parameters()]
    numel = sum(p.numel() for p in params)
    buckets = build_buckets(params[::-1], Plan().bucket_mb * 2**20, last_extra=1 + len(params),
                            first_bytes=DDP_FIRST_BUCKET_MB * 2**20)
    assert len(buckets) == 2   # 1 MiB first, then the rest: the tiny GPT's 3.3 MiB
    ddp = LinkModel({"dp": Link(BW, LAT)}, sleep=lambda s: None)
    _charged(ddp, *(b.buffer.numel() for b in buckets))
    lat, nbytes = _planner_link(Plan(dp=NPROC))
    assert lat == pytest.approx(2 * 6 * LAT, rel=1e-12)   # 2(N - 1) ring steps a bucket
    assert lat + nbytes / BW == pytest.approx(ddp.charged["dp"], rel=1e-5)
    link_bytes = (ddp.charged["dp"] - lat) * BW
    assert link_bytes - nbytes == pytest.approx(1.5 * 4 * (len(params) - 13 * 4), abs=1e-3)
    for h in (8, 32):
        dil = LinkModel({"dp": Link(BW, LAT)}, sleep=lambda s: None)
        _charged(dil, 1, numel)   # the round's collectives, all on its H-th step
        lat, nbytes = _planner_link(Plan(dp=NPROC, dp_mode="diloco", sync_every=h))
        assert h * lat == pytest.approx(2 * 6 * LAT, rel=1e-12)
        assert (dil.charged["dp"] - h * lat) * BW - h * nbytes == pytest.approx(8 - 6, abs=1e-3)


def test_a_methods_warm_up_is_timed_by_ddps_run(tmp_path):
    """The K warm-up steps are DDP's (same bytes): how long the method's run took for them
    (machine noise) changes neither its time to the target nor either crossover."""
    flags = slowlink.DILOCO + ["8", "--sync-warmup-steps", "32"]
    ddp_link = _planner_link(Plan(dp=NPROC))
    lat, nbytes = _planner_link(xover.plan_of(flags, NPROC))
    round_link = lambda i: (ddp_link if i < 32 else
                            (8 * lat, 8 * nbytes) if i % 8 == 7 else (0.0, 0.0))
    _write_run(tmp_path / "ddp", lambda i: ddp_link, reach_at=70.5, seed=1)
    rows = {"ddp": slowlink._row(tmp_path / "ddp", BW)}
    for name, seed in (("calm", 2), ("busy", 2)):
        _write_run(tmp_path / name, round_link, reach_at=99.5, seed=seed)
        rows[name] = slowlink._row(tmp_path / name, BW)
    busy = rows["busy"]
    for key in ("step_s", "compute"):
        busy[key][:32] = [x + 0.1 for x in busy[key][:32]]
    busy["records"][:32] = [(c + 0.1, s) for c, s in busy["records"][:32]]
    slowlink._compare(rows, {"ddp": [], "calm": flags, "busy": flags},
                      dict(model="tiny", nproc=NPROC, batch=BATCH, seq=None, latency=LAT))
    for key in ("s_to_target", "crossover_Bps", "planner_crossover_Bps"):
        assert rows["busy"][key] == rows["calm"][key]
    assert rows["calm"]["s_to_target"] == pytest.approx(
        sum(rows["ddp"]["step_s"][:32]) + xover.upto(rows["calm"]["step_s"][32:], 99.5 - 32))


def test_the_planners_powersgd_link_terms_are_what_the_emulated_link_charges():
    """PowerSGD's step all-reduces every P with what travels whole (1-D gradients, matrices
    too small to gain, the loss and the used flags), then every Q (powersgd.py): the
    planner's latency is the link's exactly, its bytes the link's but for the used flags
    (13 per block against the GPT's 15) and the loss."""
    params = list(GPT(gpt_config("tiny")).parameters())
    rank, whole, p_numel, q_numel = 4, 0, 0, 0
    for p in params:
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        r = min(rank, rows, cols)
        if p.dim() >= 2 and rows * cols > 2.0 * (rows + cols) * r:
            p_numel, q_numel = p_numel + rows * r, q_numel + cols * r
        else:
            whole += p.numel()
    link = LinkModel({"dp": Link(BW, LAT)}, sleep=lambda s: None)
    _charged(link, p_numel + whole + 1 + len(params), q_numel)
    plan = xover.plan_of(["--compression", "powersgd", "--compression-rank", "4"], NPROC)
    lat, nbytes = _planner_link(plan)
    assert lat == pytest.approx(2 * 6 * LAT, rel=1e-12)
    link_bytes = (link.charged["dp"] - lat) * BW
    assert link_bytes - nbytes == pytest.approx(1.5 * 4 * (len(params) - 13 * 4), abs=1e-3)
    # and the bench's planner crossover prices it from those terms
    bw = xover.planner_crossover_at_target("tiny", NPROC, BATCH, None, LAT, plan,
                                           (100, 10.0), (100, 10.5))
    ddp_lat, ddp_bytes = _planner_link(Plan(dp=NPROC))
    assert 10.0 + 100 * (ddp_lat + ddp_bytes / bw) == pytest.approx(
        10.5 + 100 * (lat + nbytes / bw), rel=1e-6)
