"""float8 priced: the card's float8 peak from the data sheets (core/gpus.py), the block
linears' matmuls at it, the float8 casts a linear's backward holds, and the MFU stated
against the bf16 peak (torchtitan's convention) in the plan's and the bench's outputs."""
import json

import pytest

from meshtrain.core.flops import float8_basis
from meshtrain.core.gpus import GPUS, peak_flops
from meshtrain.core.plan import Plan
from meshtrain.planner import hardware, report
from meshtrain.planner.advisor import advise, evaluate
from meshtrain.planner.compute_time import micro_batch_compute
from meshtrain.planner.memory import stage_memories
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.time_model import tp_comm_time

SPEC = ModelSpec(   # a small Llama-shaped model, its numbers by hand
    "llama-small", layers=4, hidden=512, heads=8, vocab=1024, seq=256, ffn=1536, kv_heads=2,
    mlp="swiglu", bias=False, norm="rmsnorm", tied=False, learned_pos=False, dropout=False,
    flash_attention=True)
H, KV, F, L, S = 512, 128, 1536, 4, 256


def test_float8_peaks_are_the_data_sheets_dense_figures():
    # H100 / H200 SXM: 3,958 TFLOPS float8 with sparsity, 1,979 dense; L4: 485 / 242.5;
    # Ampere and Volta have no float8 tensor cores
    assert peak_flops(GPUS["H100-80GB"], "fp8") == peak_flops(GPUS["H200-141GB"], "fp8") == 1979e12
    assert peak_flops(GPUS["L4-24GB"], "fp8") == 242.5e12
    assert [peak_flops(GPUS[k], "fp8") for k in ("A100-80GB", "V100-32GB", "A10G-24GB")] == [None] * 3


@pytest.mark.parametrize("recompute,every,runs", [("none", 1, 3), ("full", 2, 3.5)])
def test_an_fp8_plan_runs_its_block_linears_at_the_float8_peak(recompute, every, runs):
    """The block linears' FLOPs, 2 (2h^2 + 2h kv + 3h f) per token and layer, forward and
    both backward GEMMs (3x; a fully recomputed layer's forward again: 3.5x at every=2), move
    from 50% of 989 TFLOP/s to 50% of 1,979; attention and the output layer stay in bf16."""
    b = 2
    plan = dict(recompute=recompute, recompute_every=every)
    times = {}
    for precision in ("bf16", "fp8"):
        cluster = hardware.make_cluster("H100-80GB", precision=precision)
        cand = Candidate(Plan(precision=precision, **plan), b, recompute)
        times[precision] = micro_batch_compute(SPEC, cand, cluster, b, precision)
    linear = b * S * L * runs * 2 * (2 * H * H + 2 * H * KV + 3 * H * F)
    saved = linear / (0.5 * 989e12) - linear / (0.5 * 1979e12)
    assert times["bf16"] - times["fp8"] == pytest.approx(saved, rel=1e-9)


def test_the_mfu_of_an_fp8_plan_is_against_the_bf16_peak_and_says_so():
    setup = Setup(global_batch=8, micro_batch=2, precision="fp8", recompute="none")
    cluster = hardware.make_cluster("H100-80GB", 1, 8, precision="fp8")
    assert (cluster.peak_flops, cluster.fp8_flops) == (989e12, 1979e12)
    ev = evaluate(SPEC, Candidate(Plan(dp=8, precision="fp8"), 1, "none"), setup, cluster)
    model_flops = 8 * S * 3 * (L * (2 * (2 * H * H + 2 * H * KV + 3 * H * F) + 4 * S * H)
                               + 2 * H * 1024)
    assert ev.mfu == pytest.approx(model_flops / (ev.time.total * 8 * 989e12), rel=1e-9)
    advice = advise(SPEC, setup, cluster)
    assert "989 TFLOP/s bf16 peak (MFU's basis), block linears at the float8 1.98 PFLOP/s" \
        in report.words(advice)
    assert json.loads(report.to_json(advice, 1))["mfu_peak"] == "bf16"
    # the bench's and the train summary's peak source says the same
    assert float8_basis("NVIDIA H100 80GB HBM3") == (
        "fp8 run: MFU against the bf16 peak, as torchtitan reports it; the card's float8 "
        "peak 1979 TFLOP/s")
    assert float8_basis(None) == "fp8 run: MFU against the bf16 peak, as torchtitan reports it"


def test_an_fp8_block_backward_holds_its_float8_casts():
    """Beside bf16's: the MLP's largest linear's casts, 1 byte an element: its weight h f,
    its output gradient twice (2 f per token, the gate/up projection's f-wide output) and
    its input (h per token). Activations and states are bf16's: torchao saves the bf16
    input and weight for backward."""
    b = 2
    mems = {}
    for precision in ("bf16", "fp8"):
        setup = Setup(global_batch=4, micro_batch=b, precision=precision)
        cand = Candidate(Plan(pp=2, microbatches=2, precision=precision), b, "none")
        mems[precision] = stage_memories(SPEC, cand, setup)[0]   # a stage before the loss
    bf16, fp8 = mems["bf16"], mems["fp8"]
    assert fp8.transient - bf16.transient == H * F + b * S * (2 * F + H)
    assert (fp8.activations, fp8.model_states) == (bf16.activations, bf16.model_states)


def test_fp8_on_a_card_without_float8_is_refused_naming_it():
    with pytest.raises(hardware.HardwareError, match="the A100-80GB has no float8 tensor cores"):
        hardware.make_cluster("A100-80GB", precision="fp8")
    assert Setup(precision="fp8").optim_bytes == 12   # fp32 masters and Adam's moments


def test_fp8_under_tp_adds_its_amax_all_reduces():
    """Under tp each block linear all-reduces two amaxes per micro-batch (its weight's, and
    its split input's or output gradient's: strategies/float8.SplitFloat8), 4 bytes each
    (rowwise: one per token of the micro-batch): 2 x 7 linears x 4 layers all-reduces over
    tp beside bf16's collectives."""
    cluster = hardware.make_cluster("H100-80GB", 1, 8, precision="fp8")
    setup = {p: Setup(global_batch=8, micro_batch=2, precision=p, recompute="none")
             for p in ("bf16", "fp8")}
    plans = {"bf16": Plan(tp=2, precision="bf16"), "fp8": Plan(tp=2, precision="fp8"),
             "rowwise": Plan(tp=2, precision="fp8", fp8_recipe="rowwise")}
    times = {k: tp_comm_time(SPEC, Candidate(p, 2, "none"), setup[p.precision], cluster, 2)
             for k, p in plans.items()}
    for recipe, nbytes in (("fp8", 4), ("rowwise", 4 * 2 * S)):
        amax = cluster.collective_time("all_reduce", nbytes, 2, 2)
        assert amax > 0
        assert times[recipe] - times["bf16"] == pytest.approx(2 * 7 * L * amax, rel=1e-9)

