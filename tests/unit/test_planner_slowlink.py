"""DiLoCo / local SGD in the time model, the DDP crossover bandwidth, and the slow-link advice."""
import math

import pytest

from meshtrain.core.plan import Plan
from meshtrain.planner import Setup, make_cluster, preset
from meshtrain.planner.setup import Candidate
from meshtrain.planner.slowlink import (QUALITY_CAVEAT, CrossoverError, crossover_bandwidth,
                                        slow_link_advice)
from meshtrain.planner.states import stage_params
from meshtrain.planner.time_model import dp_comm_time, step_time
from meshtrain.planner.traffic import axis_bytes

SPEC = preset("gpt2-124m")
SETUP = Setup(global_batch=64)


def _cands(dp=16, h=8, mode="diloco"):
    ddp = Candidate(Plan(dp=dp), micro_batch=64 // dp)
    local = Candidate(Plan(dp=dp, dp_mode=mode, sync_every=h), micro_batch=64 // dp)
    return ddp, local


@pytest.mark.parametrize("mode,h", [("diloco", 8), ("diloco", 32), ("local-sgd", 8)])
def test_local_step_bytes_and_time_are_ddps_over_h(mode, h):
    ddp, local = _cands(h=h, mode=mode)
    psi = stage_params(SPEC, Plan())
    share = 15 / 16
    assert axis_bytes(SPEC, ddp, SETUP)["dp"] == pytest.approx(2 * share * psi * SETUP.grad_bytes)
    assert axis_bytes(SPEC, local, SETUP)["dp"] == pytest.approx(
        2 * share * psi * SETUP.param_bytes / h)
    cluster = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw="1Gb/s")
    t_dp, last, stats = dp_comm_time(SPEC, local, SETUP, cluster, psi)
    whole = cluster.collective_time("all_reduce", psi * SETUP.param_bytes, 16, 16)
    assert t_dp == pytest.approx(whole / h) and last == 0.0
    assert stats == pytest.approx(cluster.collective_time("all_reduce", 4, 16, 16) / h)


def test_crossover_solves_step_time_ratio():
    """A local-step plan's step is never slower than DDP's (it sends less, and its loss
    travels once per sync), so equal step times never cross; the crossover that matters is
    where DDP takes `gain` times as long (gain: the extra steps the method needs to reach
    the same loss)."""
    cluster = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw="1Gb/s")
    ddp, local = _cands(h=32)
    assert crossover_bandwidth(SPEC, SETUP, cluster, ddp, local) == math.inf
    gain = 1.5
    bw = crossover_bandwidth(SPEC, SETUP, cluster, ddp, local, gain)
    assert 1e6 < bw < 1e13
    at = lambda c, b: step_time(SPEC, c, SETUP, cluster.with_(inter_bw=b)).total
    assert at(ddp, bw) == pytest.approx(gain * at(local, bw), rel=1e-6)
    assert (gain * at(local, bw / 2) < at(ddp, bw / 2)
            and gain * at(local, bw * 2) > at(ddp, bw * 2))
    # syncing more often moves the crossover down
    assert crossover_bandwidth(SPEC, SETUP, cluster, ddp, _cands(h=8)[1], gain) < bw


def test_crossover_refuses_a_dp_axis_inside_one_node():
    cluster = make_cluster("A100-80GB", nodes=1, gpus_per_node=8)
    ddp, local = _cands(dp=8)
    with pytest.raises(CrossoverError, match="inside one node"):
        crossover_bandwidth(SPEC, SETUP, cluster, ddp, local)


def test_advice_proposes_diloco_over_1gbps_not_over_fast_links():
    ddp, _ = _cands()
    slow = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw="1Gb/s")
    text = slow_link_advice(SPEC, SETUP, slow, ddp)
    assert text and "dp_mode='diloco', sync_every=32" in text and QUALITY_CAVEAT in text
    for fast in ("ib-ndr", "nvlink4"):
        cluster = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw=fast)
        assert slow_link_advice(SPEC, SETUP, cluster, ddp) is None
    assert math.isfinite(crossover_bandwidth(SPEC, SETUP, slow, ddp, _cands()[1], 1.25))


def test_plan_words_carry_the_slow_link_advice():
    from meshtrain.planner import advise, report
    for inter, said in (("1Gb/s", True), ("ib-ndr", False)):
        cluster = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw=inter)
        text = report.words(advise(SPEC, SETUP, cluster))
        assert ("dp_mode='diloco', sync_every=32" in text) == said, text
        assert ("Slow link: for dp" in text) == said


def test_powersgd_bytes_time_and_memory_from_the_layer_shapes():
    from meshtrain.planner import from_description
    from meshtrain.planner.compression import matrix_shapes, powersgd_traffic
    from meshtrain.planner.memory import memory
    spec = from_description(layers=2, hidden=64, heads=4, vocab=100, seq=32)
    shapes = matrix_shapes(spec)
    assert sum(m * n for m, n in shapes) == spec.num_params - spec.layers * (
        spec.layer_params - spec.layer_matmul_params) - spec.norm_params
    # rank 4: per block q, k, v, o (64+64)4 each and the MLP's two (64+256)4; embeddings
    # (100+64)4 and (32+64)4; the rest (biases, norms) whole
    compressed = 2 * (4 * 128 * 4 + 2 * 320 * 4) + 164 * 4 + 96 * 4
    vectors = spec.num_params - sum(m * n for m, n in shapes)
    psgd = Candidate(Plan(dp=4, compression="powersgd", compression_rank=4), micro_batch=1)
    ddp = Candidate(Plan(dp=4), micro_batch=1)
    assert axis_bytes(spec, psgd, SETUP)["dp"] == pytest.approx(
        1.5 * (compressed + vectors) * SETUP.grad_bytes)
    # a rank past a matrix's size sends it whole: DDP's bytes
    whole = Candidate(Plan(dp=4, compression="powersgd", compression_rank=10**6), 1)
    assert axis_bytes(spec, whole, SETUP)["dp"] == pytest.approx(axis_bytes(spec, ddp, SETUP)["dp"])
    # so does a matrix whose rate M N / ((M + N) r) is at most min_rate: at rank 16 the
    # 64 x 64 ones (rate 2) go whole, the MLP's (3.2) and the token embedding's (2.4) not
    t = powersgd_traffic(spec, 16)
    assert t.p + t.q == 2 * 2 * 320 * 16 + 164 * 16
    assert t.whole == vectors + 2 * 4 * 64 * 64 + 32 * 64
    # time: two all-reduces after backward (P with the whole part and the statistics, then
    # Q), none hidden behind compute
    cluster = make_cluster("A100-80GB", nodes=4, gpus_per_node=1, inter_bw="1Gb/s")
    t4 = powersgd_traffic(spec, 4)
    t_dp, last, stats = dp_comm_time(spec, psgd, SETUP, cluster, spec.num_params)
    coll = lambda elements: cluster.collective_time("all_reduce", elements, 4, 4)
    stats_bytes = 4 * (1 + 13 * spec.layers)
    assert t_dp == pytest.approx(coll((t4.whole + t4.p) * SETUP.grad_bytes + stats_bytes)
                                 + coll(t4.q * SETUP.grad_bytes))
    assert last == t_dp and stats == 0.0
    st = step_time(spec, psgd, SETUP, cluster)
    assert st.dp_exposed == pytest.approx(t_dp)
    # memory: each compressed matrix's residual (M N) and Q (N r) beside the gradients
    kept = sum(m * n + n * 4 for m, n in shapes)
    assert memory(spec, psgd, SETUP).grads - memory(spec, ddp, SETUP).grads == pytest.approx(
        kept * SETUP.grad_bytes)


def test_advice_proposes_powersgd_in_fp32_beside_diloco():
    from meshtrain.planner.slowlink import POWERSGD_CAVEAT
    ddp, _ = _cands()
    slow = make_cluster("A100-80GB", nodes=2, gpus_per_node=8, inter_bw="1Gb/s")
    text = slow_link_advice(SPEC, SETUP, slow, ddp)
    assert "compression='powersgd', compression_rank=4 (fp32)" in text and POWERSGD_CAVEAT in text
    psgd = Candidate(Plan(dp=16, compression="powersgd", compression_rank=4), 64 // 16)
    fp32 = Setup(global_batch=64, precision="fp32")
    t = step_time(SPEC, psgd, fp32, slow).total
    assert f"({t * 1e3:.4g} ms/step predicted" in text   # priced in fp32, as it runs


@pytest.mark.parametrize("mode, buffers", [("diloco", 3), ("local-sgd", 2)])
def test_memory_counts_diloco_anchor_momentum_and_sync_buffer(mode, buffers):
    """A DiLoCo worker holds DDP's states plus three fp32 parameter-sized buffers (the
    anchor, the outer momentum, the pseudo-gradient's buffer: diloco.py's memory()); local
    SGD's outer SGD has no momentum, so two."""
    from meshtrain.planner.memory import memory
    ddp, local = _cands(h=8, mode=mode)
    psi = stage_params(SPEC, Plan())
    extra = memory(SPEC, local, SETUP).optim - memory(SPEC, ddp, SETUP).optim
    assert extra == pytest.approx(buffers * psi * 4)
