"""The CUDA tier: every strategy on the GPU equals one process on the same GPU.

Run it on a machine with a GPU: `pytest -m cuda tests/gpu` (meshtrain/bench/gpu_checks.sh does,
beside `meshtrain train`). Where no GPU is visible every test here is skipped.

The equivalences are the CPU suite's own (tests/multirank/device_cases.py, whose checks the
CPU suite runs too), on `run_ranks(..., device="cuda")`: one rank per GPU over NCCL where
there are GPUs enough ("cpu:gloo,cuda:nccl"; on one GPU, the world-1 plans), else 2-8 ranks
sharing the GPU(s) over gloo. Both sides run with TF32 off and deterministic algorithms on
(`device_cases.deterministic`), so they meet the CPU's 1e-5.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from meshtrain.testing import run_ranks
from tests.multirank import device_cases as dc

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")]


def where_am_i() -> tuple:
    import torch.distributed as dist

    from meshtrain.core.mesh import Mesh
    import meshtrain as mt

    mesh = Mesh.build(mt.Plan(dp=dist.get_world_size()))
    return dist.get_backend(), str(mesh.device), torch.cuda.current_device()


def test_each_rank_runs_on_the_gpu_of_its_local_rank():
    gpus = torch.cuda.device_count()
    world = min(gpus, 2)
    expected = [("cpu:gloo,cuda:nccl", f"cuda:{r}", r) for r in range(world)]
    assert [tuple(r) for r in run_ranks(world, where_am_i, device="cuda")] == expected
    shared = run_ranks(gpus + 1, where_am_i, device="cuda")   # more ranks than GPUs: gloo
    assert [r[0] for r in shared] == ["gloo"] * (gpus + 1)
    assert [r[1] for r in shared] == [f"cuda:{r % gpus}" for r in range(gpus + 1)]


@pytest.mark.parametrize("name", sorted(dc.CASES))
def test_every_strategy_matches_one_process_on_the_gpu(name, tmp_path):
    dc.check_case(name, "cuda", tmp_path)


def test_meshtrain_train_runs_on_the_gpu_and_reports_its_memory(tmp_path):
    env = dict(os.environ, MESHTRAIN_DEVICE="cuda")
    run = subprocess.run([sys.executable, "-m", "meshtrain", "train", "--steps", "5",
                          "--no-progress", "--run-dir", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["memory_per_rank"]) == torch.cuda.device_count()
    for memory in summary["memory_per_rank"]:
        assert 0 < memory["device_allocated"] <= memory["device_peak"]
    assert "GPU rank 0" in run.stdout


def test_offloaded_gradients_land_in_pinned_buffers_reused_every_step():
    """offload='cpu' beside a GPU: the reduced gradients reach the pinned host masters by
    non-blocking copies into pinned buffers kept between steps, equal to a plain copy."""
    from meshtrain.strategies.shared.precision import MasterWeights

    compute = [torch.randn(1000, device="cuda", dtype=torch.bfloat16)]
    masters = MasterWeights(compute, "bf16", device=torch.device("cpu"))
    masters.masters[0].data = masters.masters[0].data.pin_memory()
    buffers = []
    for _ in range(2):
        grad = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
        masters.set_grads([grad])
        got = masters.masters[0].grad
        assert got.is_pinned() and got.dtype == torch.float32
        assert torch.equal(got, grad.float().cpu())
        buffers.append(got.data_ptr())
        masters.write_back()
    assert buffers[0] == buffers[1]


def pinned_report(zero: int) -> dict:
    """Two bf16 steps under offload='cpu' on this rank's GPU: the memory report's pinned
    bytes beside what the buffers the sync reports hold, read from the host allocator."""
    import meshtrain as mt
    from meshtrain.core.device import pinned_bytes
    from meshtrain.core.memory import storage_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    trainer = mt.Trainer(model, mt.Plan(zero=zero, offload="cpu", precision="bf16"),
                         loss_fn=loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    x = torch.randint(0, 16, (4, 5), device=trainer.mesh.device)
    for _ in range(2):
        trainer.step(x, x)
    buffers = trainer.data_parallel.pinned_buffers()
    report = trainer.memory_report()
    moments = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {"reported": report.host_pinned, "pinned": pinned_bytes(buffers),
            # the masters and AdamW's two moments, all on the host
            "on_host": report.optimizer_on_host,
            "masters_and_moments": storage_bytes(trainer.data_parallel.masters.masters + moments),
            "all_pinned": all(b.is_pinned() for b in buffers),
            "grad_buffers": storage_bytes(trainer.data_parallel.masters.grad_buffers())}


@pytest.mark.parametrize("zero", [1, 3])
def test_host_pinned_counts_every_pinned_buffer_of_the_offload(zero):
    """host_pinned is every buffer offload='cpu' pins, the gradients' host buffers too; the
    optimizer's bytes in host memory are its masters and moments."""
    report = run_ranks(1, pinned_report, zero, device="cuda")[0]
    assert report["all_pinned"] and report["reported"] == report["pinned"]
    assert report["grad_buffers"] > 0
    assert report["on_host"] == report["masters_and_moments"] > 0


def test_the_stopwatch_times_the_gpu_work_not_its_launch():
    from meshtrain.core.device import Stopwatch

    a = torch.randn(4096, 4096, device="cuda")
    watch = Stopwatch(torch.device("cuda", torch.cuda.current_device()))
    watch.start()
    begin = watch.mark()
    for _ in range(20):
        a = a @ a / 4096
    end = watch.mark()
    assert watch.seconds(end) > watch.seconds(begin) >= 0
    assert watch.seconds(end) - watch.seconds(begin) > 1e-4   # 20 matmuls of 4096^2: > 0.1 ms


def test_the_peak_meter_reads_the_memory_the_caching_allocator_reserves():
    """From an emptied cache a 64 MiB block (a multiple of the allocator's 2 MiB rounding of
    large blocks) reserves exactly 64 MiB more; a second one, served from the cache, nothing."""
    from meshtrain.measure.peaks import DevicePeak, peak_meter

    gpu = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(gpu)
    torch.cuda.empty_cache()
    meter = peak_meter(gpu)
    assert isinstance(meter, DevicePeak)
    for grows in (64 * 2**20, 0):
        meter.start()
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=gpu)
        del block
        assert meter.stop() == grows


def test_verify_meters_a_gpu_ranks_peak_on_the_gpu():
    """`plan --verify` on a GPU rank: the peak is the GPU memory reserved over the window,
    which held the model states and the step's peak of live tensors."""
    from meshtrain.measure.verify import verify_rank

    tiny = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32)
    r = run_ranks(1, verify_rank, tiny, {"dp": 1}, 4, 2, 1, device="cuda")[0]
    assert r["peak_growth"] >= r["peak_alloc"] > r["model_states"] > 0


def test_calibration_times_the_hosts_work_on_a_gpt_too_narrow_to_keep_the_gpu_busy():
    """The host's runs (runs.HOST_RUNS) on the GPU: a deeper GPT's step and more micro-batches
    cost the host more, so the fit finds a positive cost per block and per step."""
    from meshtrain.measure.calibrate import host_step
    from meshtrain.measure.fit import fit_host
    from meshtrain.measure.runs import HOST_RUNS

    steps = [host_step(1, *run) for run in HOST_RUNS]
    short, deep, many, _ = steps
    assert short < deep < many
    fit = fit_host([steps])
    assert fit["per_block"] > 0 and fit["per_step"] > 0 and fit["recompute_blocks"] >= 1
