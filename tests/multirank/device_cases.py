"""Every strategy's equivalence to one process, as cases any device runs.

One case is a plan, a model, an optimizer, a clip and a world; `check_case(name, device)`
trains the plan on `run_ranks(world, ..., device=device)` and the one-process reference on the
same device, and compares them with the equivalence harness's own checks. The CUDA tier
(tests/gpu) runs every case; the CPU suite runs a few (test_device_cases.py), so this code is
exercised wherever the suite runs.

On CUDA the check runs with TF32 off (matmuls and cuDNN in full fp32) and deterministic
algorithms on (CUBLAS_WORKSPACE_CONFIG=:4096:8): one process and the plan then differ only
by the order of their sums, as on CPU, and meet the same 1e-5.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import meshtrain as mt
from meshtrain.strategies.zero.offload import OffloadNotice
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases   # registers the transformers presets with eq.MODELS


@dataclass(frozen=True)
class Case:
    world: int
    plan: dict
    model: str = "gpt"
    optimizer: str = "sgd"
    clip: float | None = None
    plan_kw: dict = field(default_factory=dict)

    @property
    def bf16(self) -> bool:
        return self.plan.get("precision") == "bf16"


PIPE = dict(pp=2, microbatches=4)
STEPS = 10
CASES = {
    # world-1 plans: on one GPU, NCCL itself
    "ddp-world1": Case(1, dict(dp=1), clip=0.3),
    "zero3-world1": Case(1, dict(dp=1, zero=3), optimizer="adamw"),
    "bf16-world1": Case(1, dict(dp=1, precision="bf16")),
    # data parallel and ZeRO
    "ddp": Case(2, dict(dp=2, microbatches=2), clip=0.3),
    "zero1": Case(2, dict(dp=2, zero=1), optimizer="adamw"),
    "zero2": Case(2, dict(dp=2, zero=2), clip=0.3),
    "zero3": Case(2, dict(dp=2, zero=3), model="tied", clip=0.3),
    "offload-cpu": Case(2, dict(dp=2, zero=2, offload="cpu"), optimizer="adamw"),
    "offload-disk": Case(2, dict(dp=2, zero=3, offload="disk")),
    "bf16": Case(2, dict(dp=2, precision="bf16")),
    "recompute": Case(2, dict(dp=2, recompute="full"), clip=1.0),
    "dp-master": Case(1, dict(dp=2, dp_mode="dp"), clip=0.3),
    "ps-sync": Case(3, dict(dp=3, dp_mode="ps-sync", ps_shards=2), clip=0.3),
    "ps-async": Case(3, dict(dp=3, dp_mode="ps-async")),   # staleness 0: exact
    # tensor and pipeline parallel
    "tp-sp": Case(2, dict(tp=2, sequence_parallel=True), model="gpt_tp", clip=0.2),
    **{f"pp-{s}": Case(2, dict(PIPE, schedule=s), model="gpt_pipe")
       for s in ("naive", "gpipe", "1f1b", "zb-h1")},
    "pp-interleaved": Case(2, dict(PIPE, schedule="interleaved", virtual_stages=2),
                           model="gpt_pipe"),
    "3d": Case(8, dict(PIPE, dp=2, tp=2, zero=1, sequence_parallel=True),
               clip=0.25),
    # context parallel: the ring's send/recv and the all-to-all's exchanges
    "cp-ring": Case(2, dict(cp=2), model="gpt_tp", clip=0.3),
    "cp-a2a-zero3": Case(4, dict(dp=2, cp=2, zero=3, cp_style="all-to-all"), model="gpt_tp"),
    # compiled blocks (inductor: triton kernels on the GPU)
    "compile-world1": Case(1, dict(dp=1, compile=True), clip=0.3),
    "compile-zero3": Case(2, dict(dp=2, zero=3, compile=True)),
    "compile-tp-sp": Case(2, dict(tp=2, sequence_parallel=True, compile=True), model="gpt_tp",
                          clip=0.2),
    # ... replayed as CUDA graphs (inductor alone where the ranks are CPUs): accumulation
    # over micro-batches (a step's graphs after another's), and gradient hooks beside them
    "cudagraphs-world1": Case(1, dict(dp=1, microbatches=2, compile="cudagraphs"), clip=0.3),
    "cudagraphs-ddp": Case(2, dict(dp=2, compile="cudagraphs")),
    # expert parallel: a mixture of experts' tokens over all-to-all (its router loss on)
    "ep": Case(2, dict(dp=2, ep=2), model="mixtral-tiny", clip=0.3),
    "ep-edp-zero1": Case(4, dict(dp=4, ep=2, zero=1), model="qwen3-moe-tiny"),
    # ... with a capacity factor (its kept mask on the device), and under context parallel
    "ep-capacity": Case(2, dict(dp=2, ep=2, capacity_factor=1.0), model="mixtral-tiny"),
    "cp-moe": Case(2, dict(cp=2), model="mixtral-tiny"),
    # ... and sliding windows with soft-capped scores (Gemma-2's local and global layers)
    "cp-window": Case(2, dict(cp=2, cp_style="all-to-all"), model="gemma2-tiny"),
    # ... in pipeline stages: the routing sums sent beside the hidden state over NCCL
    "ep-pp": Case(4, dict(dp=2, pp=2, ep=2), model="mixtral-tiny"),
}
# transformers models: their one-process reference is hf_cases' (a mixture's router loss)
TRANSFORMERS = ("mixtral-tiny", "qwen3-moe-tiny", "gemma2-tiny")



@contextmanager
def deterministic(device: str):
    """On CUDA: TF32 off and deterministic algorithms on while inside; nothing on CPU."""
    if device != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.use_deterministic_algorithms(saved[2])


def reference_of(case: Case, device: str) -> dict:
    with deterministic(device):
        if case.model in TRANSFORMERS:   # transformers' loss (+ a mixture's router's)
            return hf_cases.reference(case.model, STEPS, case.clip, device,
                                      case.plan.get("capacity_factor"))
        if case.bf16:
            return eq.reference_bf16(case.model, case.optimizer, device=device)
        return eq.reference(case.model, case.optimizer, max_grad_norm=case.clip, device=device)


def train_case(name: str, device: str, directory: str) -> dict:
    """On each rank: the case's plan, trained on this rank's device."""
    case = CASES[name]
    kw = dict(case.plan_kw)
    if case.plan.get("offload") == "disk":
        kw["offload_dir"] = directory
    with deterministic(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadNotice)   # offload="cpu" on a CPU machine
        ours = eq.train(mt.Plan(**case.plan), case.model, case.optimizer, steps=STEPS,
                        max_grad_norm=case.clip, **kw)
        # AdamW's bound: the drift torch's own DDP shows on the same case (test_zero.py)
        peer = eq.train_torch_ddp(case.model, "adamw") if case.optimizer == "adamw" else None
    return {"ours": ours, "peer": peer}


def check_case(name: str, device: str, directory) -> None:
    """The case on `device` equals one process on `device` (every rank's result)."""
    from tests.multirank.test_zero import PEER_MARGIN, check_within_bf16_round_off

    case = CASES[name]
    ref = reference_of(case, device)
    per_rank = run_ranks(case.world, train_case, name, device, str(directory), device=device,
                         timeout=240)
    for rank, result in enumerate(per_rank):
        if case.bf16:
            check_within_bf16_round_off(result["ours"], ref)
            continue
        atol = 1e-5
        if result["peer"] is not None:
            atol = max(atol, PEER_MARGIN * eq.drift(result["peer"], ref))
        eq.assert_equivalent(result["ours"], ref, atol=atol,
                             what=f"{name} on {device}, rank {rank}: "
                                  f"{mt.Plan(**case.plan).describe()}")
