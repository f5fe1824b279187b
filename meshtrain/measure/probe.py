"""One launch's measurements on every rank (`measure_rank`), and how launches combine into
a world's profile entry: the slowest rank per launch, the mean over rounds."""
from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.bench.timing import alternate
from meshtrain.core.comm import Comm
from meshtrain.core.device import device_name, rank_device, synchronize
from meshtrain.core.flops import PRECISION_DTYPES
from meshtrain.core.gpus import peak_flops
from meshtrain.core.mesh import Mesh
from meshtrain.measure.peaks import allocated_peak
from meshtrain.core.plan import Plan
from meshtrain.measure.runs import (ATTENTION_SHAPES, BUDGET_S, COPY_BYTES, GEMM_SHAPES, KINDS,
                                    LAUNCH_CHAIN, MIN_REPS, QUEUED_FLOPS, SIZES, SQUARE,
                                    optimizer, reference_gpt)
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner.calibrated import attention_flops, gemm_flops
from meshtrain.planner.hardware import GPUS, device_kind, ring_factor
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.planner.profile import NARROW_GPT, REFERENCE_BATCH, SMALL_BATCH
from meshtrain.planner.flops import step_flops


def measure_rank(sizes=SIZES, budget_s: float = BUDGET_S) -> dict:
    """Run on every rank of a launched world: this rank's measurements, each the median of
    repetitions taken in alternation (bench.timing) for about `budget_s` seconds, so a slow
    phase of the machine hits every quantity alike."""
    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm = Comm(Mesh.build(Plan(dp=world)))
    device = comm.mesh.device   # what a training rank computes on (NCCL: device tensors only)
    work = device_work(device)
    torch.manual_seed(0)
    config = GPTConfig(**reference_gpt(device.type))
    # in the run's dtype (runs.py), as the Trainer runs the device's plans
    model = GPT(config).to(device, PRECISION_DTYPES[SQUARE[device.type][1]])
    x = torch.randint(0, config.vocab_size, (REFERENCE_BATCH, config.seq_len), device=device)
    # AdamW over fp32 parameters, as the Trainer's optimizer steps fp32 masters under bf16
    masters = [p if p.dtype == torch.float32 else
               torch.zeros_like(p, dtype=torch.float32, requires_grad=True)
               for p in model.parameters()]
    opt = optimizer(device.type)(masters)
    big = torch.empty(COPY_BYTES[device.type] // 4, device=device)
    dst = torch.empty_like(big)

    steps, ops = reference_steps(model, x)
    for p in masters:   # the gradients AdamW's step needs
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    work |= {**steps, **(narrow_step(x) if device.type == "cpu" else {}),
            "optimizer": (opt.step, sum(p.numel() for p in model.parameters())),
            "copy": (lambda: dst.copy_(big), 2 * big.numel() * 4)}
    rank = dist.get_rank() if world > 1 else 0
    peer = rank ^ 1   # p2p: ranks in pairs (0 -> 1, 2 -> 3), one message one way, as a
    # pipeline boundary or a push to a server sends it (an odd world's last rank sits out)

    def p2p(tensor):
        if peer < world:
            (comm.send if rank % 2 == 0 else comm.recv)(tensor, peer, "dp", tag="calibrate")

    for kind in KINDS if world > 1 else ():
        for size in sizes:
            full = torch.ones(size // 4, device=device)
            shard = torch.ones(size // 4 // world, device=device)
            run = {"all_reduce": lambda f=full: comm.all_reduce(f, "dp", tag="calibrate"),
                   "all_gather": lambda f=full, s=shard: comm.all_gather(f[:s.numel() * world], s, "dp", tag="calibrate"),
                   "reduce_scatter": lambda f=full, s=shard: comm.reduce_scatter(s, f[:s.numel() * world], "dp", tag="calibrate"),
                   "broadcast": lambda f=full: comm.broadcast(f, 0, "dp", tag="calibrate"),
                   "p2p": lambda f=full: p2p(f)}[kind]
            work[f"{kind}:{size}"] = (run, ring_factor(kind, world) * size)   # bus bytes

    sync = comm.barrier if world > 1 else (lambda: None)
    start = time.perf_counter()
    for fn, _ in work.values():   # warm-up pass, which also sizes the repetitions
        sync()
        fn()
    synchronize(device)
    # every rank must run the same collectives: all take the largest count any rank asks for
    reps = torch.tensor([max(MIN_REPS, math.ceil(budget_s / (time.perf_counter() - start)))],
                        device=device)
    comm.all_reduce(reps, "dp", op="max", tag="calibrate")
    reps = int(reps.item())
    # each measurement ends when the device has finished it (CUDA queues the work)
    times = alternate({name: _waited(fn, device) for name, (fn, _) in work.items()}, 1, reps,
                      0, sync, wait_for_all=False)
    rate = {name: amount / max(statistics.median(times[name]), 1e-9)
            for name, (_, amount) in work.items()}
    collectives = {kind: {"sizes": list(sizes), "busbw": [rate[f"{kind}:{s}"] for s in sizes]}
                   for kind in KINDS if world > 1}
    return {"world": world, "device_kind": local_kind(device), "ops_per_block": ops,
            "launch_rate": rate["launch"], **shaped(rate),
            "matmul_flops": rate["matmul"], "model_flops": rate["gpt"],
            "model_flops_small": rate["gpt_small"], "mem_bw": rate["copy"], "optimizer_rate": rate["optimizer"], "reps": reps,
            **({"model_flops_narrow": rate["gpt_narrow"]} if "gpt_narrow" in rate else {}),
            "collectives": collectives, **_optimizer_temporaries(opt, masters, device)}


def reference_steps(model: GPT, x: torch.Tensor) -> tuple[dict, float]:
    """The reference GPT's training step (forward and backward) at REFERENCE_BATCH and
    SMALL_BATCH, as name -> (step, FLOPs), and the ops a block of it dispatches; it has run
    once (its gradients exist)."""
    spec = from_gpt_config(model.config)
    train_step, small = training_step(model, x), training_step(model, x[:SMALL_BATCH].clone())
    train_step()
    return ({"gpt": (train_step, step_flops(spec, REFERENCE_BATCH)),
             "gpt_small": (small, step_flops(spec, SMALL_BATCH))},
            ops_per_block(train_step, model.config.n_layer))


def narrow_step(x: torch.Tensor) -> dict:
    """The reference GPT at half its width (NARROW_GPT), trained on the same batch: what of
    a step grows with the width and what with its square (profile.elementwise_split). CPU
    ranks only: a GPU's elementwise work is priced from its own kernels (flops.py)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**NARROW_GPT))
    step = training_step(model, x)
    step()
    return {"gpt_narrow": (step, step_flops(from_gpt_config(model.config), REFERENCE_BATCH))}


def training_step(model: GPT, batch: torch.Tensor):
    """One forward and backward of `model` on `batch` (the next token its own target)."""
    def step():
        model.zero_grad(set_to_none=False)
        model.loss(model(batch), batch).backward()
    return step


def _optimizer_temporaries(opt, masters: list[torch.Tensor], device: torch.device) -> dict:
    """On CUDA, the bytes per parameter the optimizer's step allocates beside its states
    (the memory model's optimizer moment: Cluster.optimizer_temporaries); a CPU profile
    keeps its fields."""
    if device.type != "cuda":
        return {}
    return {"optimizer_temporaries": allocated_peak(opt.step, device)
            / sum(p.numel() for p in masters)}


def local_kind(device: torch.device | None = None) -> str:
    """The device kind of this machine's ranks (hardware.device_kind): its profile's name."""
    return device_kind(device_name(device or rank_device()), os.cpu_count())


def device_work(device: torch.device) -> dict:
    """The device's own figures as name -> (step, amount per step) in the run's dtype (runs.py):
    a square matmul (FLOPs), each GEMM shape ("gemm:M,K,N", FLOPs), each causal attention's
    forward and backward ("attention:B,H,S,D", FLOPs as flops.py counts them), and a chain of
    tiny ops ("launch", ops)."""
    n, precision = SQUARE[device.type]
    dtype = PRECISION_DTYPES[precision]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    work = {"matmul": (lambda: a @ b, 2 * n**3)}
    queued = QUEUED_FLOPS[device.type]
    for m, k, cols in GEMM_SHAPES[device.type]:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(k, cols, device=device, dtype=dtype)
        work[f"gemm:{m},{k},{cols}"] = queued_work(lambda x=x, w=w: x @ w,
                                                   gemm_flops(m, k, cols), queued)
    for shape in ATTENTION_SHAPES[device.type]:
        q, k, v, grad = (torch.randn(shape, device=device, dtype=dtype, requires_grad=i < 3)
                         for i in range(4))
        work["attention:" + ",".join(map(str, shape))] = queued_work(
            lambda q=q, k=k, v=v, g=grad: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g),
            attention_flops(*shape), queued)
    tiny = torch.zeros(1, device=device)

    def chain():
        for _ in range(LAUNCH_CHAIN):
            tiny.add_(1)
    return work | {"launch": (chain, LAUNCH_CHAIN)}


def queued_work(fn, flops: float, queued: float) -> tuple:
    """(`fn` called n times in a row, n x `flops`): n the calls that queue about `queued`
    FLOPs (runs.QUEUED_FLOPS), at least one."""
    n = max(1, round(queued / flops))
    if n == 1:
        return fn, flops

    def repeated():
        for _ in range(n):
            fn()
    return repeated, n * flops


def shaped(rate: dict) -> dict:
    """The GEMM and attention rates of `rate` as curves: {"shapes", "flops_per_call", "flops"}."""
    curves = {}
    for family, count in (("gemm", gemm_flops), ("attention", attention_flops)):
        names = [n for n in rate if n.startswith(family + ":")]
        dims = [[int(d) for d in n.split(":")[1].split(",")] for n in names]
        curves[family] = {"shapes": dims, "flops_per_call": [count(*d) for d in dims],
                          "flops": [rate[n] for n in names]}
    return curves


class _OpCount(TorchDispatchMode):
    """Counts the operators dispatched while active, views aside (they launch no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_block(step, layers: int) -> float:
    """Operators one block dispatches in `step` (a training step of a GPT of `layers`
    blocks), the embedding, head and loss counted as one more block (as step_costs)."""
    with _OpCount() as count:
        step()
    return count.ops / (layers + 1)


def add_efficiencies(entry: dict, kind: str, dtype: str) -> None:
    """Each GEMM's and attention's efficiency against the device's dense peak: the table's
    for a GPU it knows (at `dtype`), else the square matmul measured beside them."""
    gpu = GPUS.get(kind)
    peak = (peak_flops(gpu, dtype) if gpu else None) or entry["matmul_flops"]
    for family in ("gemm", "attention"):
        curve = entry.get(family)
        if curve:
            curve["efficiency"] = [f / peak for f in curve["flops"]]
    entry["peak_flops"] = peak


def _waited(fn, device: torch.device):
    def run() -> None:
        fn()
        synchronize(device)
    return run


RATES = ("matmul_flops", "model_flops", "model_flops_small", "model_flops_narrow", "mem_bw",
         "optimizer_rate", "launch_rate", "optimizer_temporaries")
CURVES = ("gemm", "attention")   # FLOP/s per shape
SAME = ("device_kind", "ops_per_block")   # the same on every rank and round: the first's


def combine(results: list[dict]) -> dict:
    """One launch's entry: the slowest rank's rates (the step waits for it)."""
    return _reduce(results, min)


def mean_of_rounds(entries: list[dict]) -> dict:
    """One world's entry from its rounds: each rate, and each point of each curve, the mean
    over the rounds. Each round is already a median (no single outlier moves it); the rounds
    fall in the machine's fast or slow phases, and the mean sits between them where a median
    of few rounds would pick one phase."""
    entry = _reduce(entries, statistics.fmean)
    entry["per_round"] = {key: [e[key] for e in entries] for key in RATES if key in entries[0]}
    return entry


def _reduce(entries: list[dict], reduce) -> dict:
    """Entries (ranks' or rounds') as one: `reduce` over each rate and over each point of
    each curve (GEMM and attention FLOP/s, collective bandwidths); what is the same
    everywhere, the first's."""
    first = entries[0]
    points = lambda curves: [reduce(col) for col in zip(*curves)]
    entry = {key: reduce([e[key] for e in entries]) for key in RATES if key in first}
    entry |= {key: first[key] for key in SAME if key in first}
    entry |= {family: {**first[family], "flops": points(e[family]["flops"] for e in entries)}
              for family in CURVES if family in first}
    entry["collectives"] = {
        kind: {"sizes": curve["sizes"],
               "busbw": points(e["collectives"][kind]["busbw"] for e in entries)}
        for kind, curve in first["collectives"].items()}
    return entry
