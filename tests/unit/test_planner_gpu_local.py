"""`--cluster local` and `plan --verify` on GPU ranks (a profile calibrated on CUDA), with no
GPU: a profile dict shaped like docs/profiles/H100-80GB.json fed to the time and memory
model, each term against its arithmetic; and the GPTs and dtype chosen per device type, CPU's
left as they were."""
import pytest
import torch

from meshtrain.core.plan import Plan
from meshtrain.measure import runs, verify
from meshtrain.models.gpt import GPTConfig
from meshtrain.planner import memory as mm
from meshtrain.planner.calibrated import efficiency_at, gemm_flops, model_efficiency
from meshtrain.planner.flops import ELEMENTWISE_BYTES, LOSS_BYTES, forward_flops_per_token
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.planner.profile import REFERENCE_GPT, cluster_from_profile
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.compute_time import micro_batch_compute

SPEC = from_gpt_config(GPTConfig(**runs.VERIFY_GPTS["cuda"]))
BF16 = Setup(global_batch=8, precision="bf16")
GEMMS = [(8192, 1024, 4096), (8192, 4096, 4096)]
CURVES = {"gemm": {"shapes": [list(s) for s in GEMMS],
                   "flops_per_call": [gemm_flops(*s) for s in GEMMS], "efficiency": [0.5, 0.9]}}
ENTRY = {"matmul_flops": 7e14, "model_flops": 4e14, "model_flops_small": 1e14, "mem_bw": 2.6e12,
         "optimizer_rate": 4e10, "collectives": {}, "peak_flops": 989e12, "launch_rate": 1e5,
         "ops_per_block": 50.0, "optimizer_temporaries": 4.0, **CURVES}
GPU = {"created": "t", "cpu_count": 16, "host_mem": 1e12, "device_mem": 80e9,
       "device": {"kind": "H100-80GB", "type": "cuda", "dtype": "bf16", "count": 1},
       "worlds": {"1": ENTRY}}
CPU = {"created": "t", "cpu_count": 2, "host_mem": 8e9, "worlds": {"1": ENTRY}}


def _flops(b: int) -> float:
    layer, _, logits = forward_flops_per_token(SPEC, SPEC.seq)
    return b * SPEC.seq * (SPEC.layers * 3 * layer + 3 * logits)


def _elementwise(b: int) -> float:
    """Seconds of b sequences' elementwise work at ENTRY's copy bandwidth."""
    return b * SPEC.seq * (SPEC.layers * ELEMENTWISE_BYTES * SPEC.hidden
                           + LOSS_BYTES * SPEC.vocab) / 2.6e12


def test_a_gpu_profile_runs_the_host_beside_the_device():
    gpu, cpu = cluster_from_profile(GPU, 1), cluster_from_profile(CPU, 1)
    assert gpu.async_dispatch and not gpu.host_is_device and gpu.idle_speedup == 1.0
    assert gpu.peak_flops == 989e12 and gpu.overlap == 1.0 and gpu.optimizer_temporaries == 4.0
    assert gpu.block_overhead == pytest.approx(50 / 1e5)   # ops per block x one launch
    assert gpu.efficiency_curves == {**CURVES, "dtype": "bf16"}
    # the same figures without a CUDA device: CPU ranks, as before
    assert cpu.host_is_device and not cpu.async_dispatch and cpu.efficiency_curves is None
    assert cpu.optimizer_temporaries is None and cpu.gpu_mem == 8e9


@pytest.mark.parametrize("b", [1, 4, 16])
def test_a_micro_batch_runs_at_the_efficiency_of_its_own_gemms(b):
    gpu = cluster_from_profile(GPU, 1)
    cand = Candidate(Plan(precision="bf16"), b, "none")
    e = efficiency_at(CURVES["gemm"], gemm_flops(b * SPEC.seq, SPEC.hidden, SPEC.ffn_hidden))
    assert model_efficiency(CURVES, SPEC, b) == pytest.approx(e)
    # the GEMMs and attention at their efficiency, the elementwise work at memory speed
    device = _flops(b) / (989e12 * e) + _elementwise(b)
    dispatch = 50 / 1e5 * (SPEC.layers + 1)
    # the slower of the device's work and the host's dispatch bounds the micro-batch
    assert micro_batch_compute(SPEC, cand, gpu, b, "bf16") == pytest.approx(max(device, dispatch))
    # another precision than the curves': the reference step's rate against the peak, which
    # its elementwise work is part of
    assert micro_batch_compute(SPEC, cand, gpu, b, "fp32") == pytest.approx(
        max(_flops(b) / 4e14, dispatch))


def test_a_host_bound_micro_batch_costs_its_dispatch_and_cpu_ranks_pay_both():
    slow_host = cluster_from_profile(GPU, 1).with_(block_overhead=1.0)
    cand = Candidate(Plan(precision="bf16"), 1, "none")
    assert micro_batch_compute(SPEC, cand, slow_host, 1, "bf16") == SPEC.layers + 1
    summed = slow_host.with_(async_dispatch=False)
    assert micro_batch_compute(SPEC, cand, summed, 1, "bf16") == pytest.approx(
        SPEC.layers + 1 + _flops(1) / (989e12 * model_efficiency(CURVES, SPEC, 1))
        + _elementwise(1))


def test_the_optimizer_steps_moment_is_the_peak_when_activations_are_small():
    gpu = cluster_from_profile(GPU, 1)
    n = SPEC.num_params
    for recompute, b in (("full", 8), ("none", 1), ("none", 16)):
        plan = Plan(precision="bf16", recompute=recompute)
        cand = Candidate(plan, b, recompute)
        bare = mm.memory(SPEC, cand, BF16)
        mem = mm.memory(SPEC, cand, BF16, **gpu.memory_terms(plan))
        # beside the states: the masters' fp32 gradients (4) and AdamW's temporaries (4)
        step = bare.model_states + n * (4 + 4)
        assert mem.allocated == pytest.approx(max(bare.allocated, step))
    assert mm.optimizer_step_bytes(12 * n, BF16, 0.0) == 4 * n     # fused AdamW: none
    fp32 = Setup(global_batch=8, precision="fp32")
    assert mm.optimizer_step_bytes(8 * n, fp32, 4.0) == 4 * n      # its own masters' grads


def test_the_cpu_keeps_its_gpts_and_a_gpu_trains_one_sized_for_it_in_bf16():
    assert runs.reference_gpt("cpu") == REFERENCE_GPT
    assert verify.MODEL == dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
    assert runs.reference_gpt("cpu", 4) == {**REFERENCE_GPT, "n_layer": 4}
    gpu = runs.reference_gpt("cuda")
    assert gpu["vocab_size"] % 64 == 0 and gpu["d_model"] >= 1024 and gpu["seq_len"] >= 1024
    assert runs.VERIFY_GPTS["cuda"] == {**gpu, "n_layer": 4}
    assert runs.run_plan({"dp": 1}, "cpu") == {"dp": 1}
    assert runs.run_plan({"dp": 1, "recompute": "full"}, "cuda") == {
        "dp": 1, "recompute": "full", "precision": "bf16"}
    w = [torch.nn.Parameter(torch.zeros(2, device="cpu"))]
    assert runs.optimizer("cuda")(w).defaults["fused"] is True
    assert not runs.optimizer("cpu")(w).defaults["fused"]


def test_a_gpu_is_held_to_five_percent_on_both_peaks():
    assert verify.GPU_LIMITS == {**verify.LIMITS, "peak_alloc": 0.05, "peak_rss": 0.05}
    rows = [{"error": {"model_states": 0.0, "peak_alloc": 0.06, "peak_rss": 0.0, "step": 0.1,
                       "sent": 0.0}}]
    assert verify.summary(rows)[0] and not verify.summary(rows, verify.GPU_LIMITS)[0]


def test_a_gpu_step_is_the_slower_of_the_devices_work_and_the_hosts():
    """GPU ranks: the Trainer's fixed host cost and each micro-batch's dispatch set the step
    only where they outlast the device's work; CPU ranks add the fixed cost to it."""
    from meshtrain.planner.compute_time import dispatch_time
    from meshtrain.planner.time_model import step_time

    cand = Candidate(Plan(precision="bf16", microbatches=2), 4, "none")
    gpu = cluster_from_profile(GPU, 1)
    device = step_time(SPEC, cand, BF16, gpu).total
    host = dispatch_time(SPEC, cand, gpu)
    assert host == pytest.approx(50 / 1e5 * (SPEC.layers + 1))
    assert step_time(SPEC, cand, BF16, gpu.with_(step_overhead=0.001)).total == device
    slow = gpu.with_(step_overhead=device)   # the host's fixed work alone outlasts the device
    assert step_time(SPEC, cand, BF16, slow).total == pytest.approx(device + 2 * host)
    summed = gpu.with_(async_dispatch=False, step_overhead=0.001)
    assert step_time(SPEC, cand, BF16, summed).total == pytest.approx(
        step_time(SPEC, cand, BF16, gpu.with_(async_dispatch=False)).total + 0.001)


def test_the_gpu_trainer_fit_keeps_the_hosts_fixed_cost_out_of_device_bound_steps():
    """Calibration's Trainer fit on GPU ranks: the factor from the device-bound points (the
    larger batch, the deeper GPT), the host's fixed cost from the smallest; the fitted model
    meets all three, and a line through all three would not (it charges every step the
    smallest one's host work)."""
    from meshtrain.measure.fit import fit_trainer
    from meshtrain.measure.runs import DEEP_POINT, MEMORY_BATCHES

    reference = runs.reference_gpt("cuda")
    shapes = [(reference, b) for b in MEMORY_BATCHES]
    shapes.append(({**reference, "n_layer": DEEP_POINT[0]}, DEEP_POINT[1]))
    plan = runs.run_plan({"dp": 1}, "cuda")
    bare = [verify.predict(GPU, plan, b, model).time for model, b in shapes]
    measured = [t.total + 0.25 * t.compute for t in bare]
    measured[0] += 0.004   # the smallest step: bound by the host, 4 ms beyond the device
    fit = fit_trainer(GPU, 1, [measured, measured])
    assert fit["compute_scale"] == pytest.approx(1.25)
    assert fit["per_step"] == pytest.approx(measured[0] - 50 / 1e5 * (reference["n_layer"] + 1))
    fitted = {**GPU, "worlds": {"1": {**ENTRY, "trainer": fit}}}
    for (model, b), m in zip(shapes, measured):
        assert verify.predict(fitted, plan, b, model).time.total == pytest.approx(m, rel=1e-6)


HOST = {"per_step": 0.006, "per_layer": 0.0002, "per_block": 0.0015, "recompute_blocks": 2.5}


def _host_step(layers: int, microbatches: int, recompute: str, host: dict = HOST) -> float:
    """The host's seconds for one of HOST_RUNS, as fit_host reads them."""
    blocks = layers * (host["recompute_blocks"] if recompute == "full" else 1)
    return (host["per_step"] + host["per_layer"] * layers
            + microbatches * host["per_block"] * (blocks + 1))


def test_the_hosts_own_runs_give_its_four_costs_and_the_planner_meets_them():
    """Calibration's host runs on a GPT too narrow to keep the device busy: their four
    steps give the host's cost per step, per layer, per block and micro-batch, and of a
    recomputed block, exactly; with them in the profile, the planner's step for each run
    is that run's (the host bounds it), and the Trainer's fixed cost is the host's."""
    from meshtrain.measure.fit import fit_host, fit_trainer

    steps = [_host_step(*run) for run in runs.HOST_RUNS]
    fit = fit_host([steps, [t * 1.5 for t in steps], steps])   # the median round
    assert {k: fit[k] for k in HOST} == pytest.approx(HOST)
    entry = {**ENTRY, "host": fit}
    profile = {**GPU, "worlds": {"1": entry}}
    gpu = cluster_from_profile(profile, 1)
    assert (gpu.block_overhead, gpu.layer_step_overhead, gpu.recompute_dispatch) == \
        pytest.approx((0.0015, 0.0002, 2.5))
    bare = [verify.predict(GPU, runs.run_plan({"dp": 1}, "cuda"), b, model).time
            for model, b in [(runs.reference_gpt("cuda", layers), b)
                             for layers, b, m in runs.MEMORY_RUNS if m == 1]]
    entry["trainer"] = fit_trainer(profile, 1, [[t.total for t in bare]])
    assert entry["trainer"]["per_step"] == pytest.approx(0.006)
    for layers, m, recompute in runs.HOST_RUNS:
        plan = runs.run_plan({"dp": 1, "microbatches": m, "recompute": recompute}, "cuda")
        model = {**runs.HOST_GPT, "n_layer": layers}
        assert verify.predict(profile, plan, m, model).time.total == pytest.approx(
            _host_step(layers, m, recompute), rel=1e-9)
    from meshtrain.measure.calibrate import describe

    assert ("the host's 6.0 ms + 0.20 ms per layer + 1.50 ms per block and micro-batch (a "
            "recomputed block 2.50 blocks)") in describe(profile)


def test_the_hosts_fit_never_goes_below_zero_nor_a_recomputed_block_below_one():
    from meshtrain.measure.fit import fit_host

    flat = [0.01] * len(runs.HOST_RUNS)   # no step longer than another: all fixed cost
    fit = fit_host([flat])
    assert (fit["per_block"], fit["per_layer"], fit["recompute_blocks"]) == (0.0, 0.0, 1.0)
    assert fit["per_step"] == pytest.approx(0.01)
    cheap = [_host_step(*run, host={**HOST, "recompute_blocks": 0.5}) for run in runs.HOST_RUNS]
    assert fit_host([cheap])["recompute_blocks"] == 1.0


def test_elementwise_work_is_priced_apart_only_beside_gemm_and_attention_rates():
    """A rate measured on GEMMs and attention alone (a GPU profile's curves, or a preset
    calibrated with one) leaves the elementwise work out: it runs at the memory's speed,
    recomputation's second forward a third more. A rate measured on whole steps (a CPU
    profile, a preset's achievable efficiency) has it inside."""
    cand = Candidate(Plan(precision="bf16"), 4, "none")
    gpu = cluster_from_profile(GPU, 1)
    apart = micro_batch_compute(SPEC, cand, gpu, 4, "bf16")
    whole = micro_batch_compute(SPEC, cand, gpu.with_(efficiency_curves=None), 4, "bf16")
    assert apart - _flops(4) / (989e12 * model_efficiency(CURVES, SPEC, 4)) == pytest.approx(
        _elementwise(4))
    assert whole == pytest.approx(_flops(4) / gpu.achievable_flops)
    preset = gpu.with_(efficiency_curves=None, elementwise_apart=True)
    assert micro_batch_compute(SPEC, cand, preset, 4, "bf16") == pytest.approx(
        whole + _elementwise(4))
    full = Candidate(Plan(precision="bf16", recompute="full"), 4, "full")
    layer, _, _ = forward_flops_per_token(SPEC, SPEC.seq)
    recomputed = micro_batch_compute(SPEC, full, preset, 4, "bf16")
    assert recomputed - whole - 4 * SPEC.seq * SPEC.layers * layer / gpu.achievable_flops == (
        pytest.approx(_elementwise(4) + 4 * SPEC.seq * SPEC.layers / 3 * ELEMENTWISE_BYTES
                      * SPEC.hidden / 2.6e12))
