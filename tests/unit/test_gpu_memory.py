"""A CUDA rank's memory is its GPU's: `plan --verify` and `--calibrate` meter the caching
allocator's reserved peak there (not the host's resident memory), and a profile calibrated
on CUDA ranks gives each rank its GPU's memory. torch.cuda's few figures are faked here with
known numbers; tests/gpu reads the real ones."""
import os
from types import SimpleNamespace

import pytest
import torch

from meshtrain.measure import calibrate as cal
from meshtrain.measure import verify
from meshtrain.measure.peaks import DevicePeak, ResidentPeak, peak_meter
from meshtrain.planner.profile import cluster_from_profile

MiB = 2**20


class FakeAllocator:
    """The caching allocator's reserved bytes and their peak since the last reset."""

    def __init__(self, monkeypatch, reserved: int, peak: int):
        self.reserved, self.peak, self.calls = reserved, peak, []
        for name in ("synchronize", "reset_peak_memory_stats", "memory_reserved",
                     "max_memory_reserved"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        # the allocated figures differ: a meter reading them would be caught
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 7 * MiB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 9 * MiB)

    def synchronize(self, device=None):
        self.calls.append(("sync", device))

    def reset_peak_memory_stats(self, device=None):
        self.calls.append(("reset", device))
        self.peak = self.reserved

    def memory_reserved(self, device=None):
        return self.reserved

    def max_memory_reserved(self, device=None):
        return self.peak

    def grow(self, nbytes: int):
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)


def test_a_cuda_rank_meters_the_growth_of_the_allocators_reserved_peak(monkeypatch):
    gpu = torch.device("cuda", 1)
    # 300 MiB reserved before the window; an earlier peak of 900 MiB the reset must forget
    fake = FakeAllocator(monkeypatch, reserved=300 * MiB, peak=900 * MiB)
    meter = peak_meter(gpu)
    assert isinstance(meter, DevicePeak)
    meter.start()
    assert fake.calls == [("sync", gpu), ("reset", gpu)]
    fake.grow(500 * MiB)    # the window's peak: 800 MiB reserved
    fake.grow(-600 * MiB)   # released again (empty_cache) before the window ends
    assert meter.stop() == 500 * MiB
    assert fake.calls[-1] == ("sync", gpu) and {d for _, d in fake.calls} == {gpu}


def test_a_cuda_window_served_from_the_cache_grows_by_nothing(monkeypatch):
    fake = FakeAllocator(monkeypatch, reserved=64 * MiB, peak=64 * MiB)
    meter = peak_meter(torch.device("cuda", 0))
    meter.start()
    assert meter.stop() == 0
    fake.grow(2 * MiB)
    assert meter.stop() == 2 * MiB


def test_a_cpu_rank_keeps_the_resident_peak():
    meter = peak_meter(torch.device("cpu"))
    assert isinstance(meter, ResidentPeak)
    meter.start()
    block = torch.ones(16 * MiB, dtype=torch.float32, device="cpu")   # 64 MiB, touched
    del block
    # the whole block, less the few file-backed pages the window touched (ResidentPeak)
    assert meter.stop() == pytest.approx(64 * MiB, rel=0.05)


def test_the_report_names_the_gpus_memory_on_cuda_and_keeps_the_cpu_header():
    assert verify.header("cpu") == verify.HEADER and "peak RSS MB" in verify.HEADER
    cuda = verify.header("cuda")
    assert "peak device MB" in cuda and "peak RSS MB" not in cuda
    assert cuda.replace("peak device MB", "   peak RSS MB") == verify.HEADER
    assert "reserves" in verify.LEGEND["cuda"] and "resident" in verify.LEGEND["cpu"]


def test_a_cuda_calibration_records_the_gpus_memory(monkeypatch):
    asked = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(total_memory=85_520_809_984)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(cal, "gpu_count", lambda: 2)
    assert cal.device_figures("cuda", "H100-80GB") == {
        "device": {"kind": "H100-80GB", "type": "cuda", "dtype": "bf16", "count": 2},
        "device_mem": 85_520_809_984}
    assert asked == [torch.device("cuda", 0)]
    assert cal.device_figures("cpu", "cpu-2") == {
        "device": {"kind": "cpu-2", "type": "cpu", "dtype": "fp32", "count": os.cpu_count()}}


def _profile(**fields) -> dict:
    curve = {"sizes": [256, 2**24], "busbw": [1e7, 1e9]}
    entry = {"matmul_flops": 1e11, "model_flops": 8e10, "mem_bw": 1e10, "optimizer_rate": 1e8,
             "collectives": {k: curve for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                "broadcast", "p2p")}}
    return {"created": "t", "cpu_count": 16, "host_mem": 8e9,
            "worlds": {"1": {**entry, "collectives": {}}, "2": entry}, **fields}


@pytest.mark.parametrize("world", [1, 2])
def test_a_profile_of_cuda_ranks_gives_each_rank_its_gpus_memory(world):
    gpu = _profile(device={"kind": "H100-80GB", "type": "cuda", "dtype": "bf16", "count": 2},
                   device_mem=85_520_809_984)
    assert cluster_from_profile(gpu, world).gpu_mem == 85_520_809_984
    # a profile from before the field (and any CPU one): the rank's share of the host's
    assert cluster_from_profile(_profile(), world).gpu_mem == 8e9 / world
    assert "85.5 GB per GPU" in cal.describe(gpu) and "per GPU" not in cal.describe(_profile())


def test_verify_on_a_gpu_skips_the_plans_its_bf16_refuses():
    """GPU ranks run every plan in bf16 (runs.run_plan); the data-parallel family but DDP
    runs in fp32 only, so --verify leaves those out there and keeps them on CPU ranks."""
    from meshtrain.measure.runs import run_plan

    fp32_only = [plan for plan, _ in verify.PLANS
                 if not verify.runs_in_its_precision(run_plan(plan, "cuda"))]
    # bf16 is refused exactly where a plan leaves DDP's bucketed all-reduce: another
    # dp_mode, or compressed gradients; each such plan of the list is one of them
    leaves_ddp = [plan for plan, _ in verify.PLANS if plan.get("dp_mode", "ddp") != "ddp"
                  or plan.get("compression", "none") != "none"]
    assert fp32_only == leaves_ddp
    assert {p.get("dp_mode", "ddp") for p in fp32_only} >= {"ps-sync", "dp", "diloco",
                                                             "local-sgd"}
    assert all(verify.runs_in_its_precision(run_plan(plan, "cpu")) for plan, _ in verify.PLANS)
