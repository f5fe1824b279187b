"""One launch's measurements on every rank (`measure_rank`), and how launches combine into
a world's profile entry: the slowest rank per launch, the mean over rounds."""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from meshtrain.bench.timing import alternate
from meshtrain.core.comm import Comm
from meshtrain.core.device import synchronize
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import Plan
from meshtrain.measure.runs import BUDGET_S, KINDS, MIN_REPS, SIZES
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner.hardware import ring_factor
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.planner.profile import REFERENCE_BATCH, REFERENCE_GPT, SMALL_BATCH
from meshtrain.planner.flops import step_flops


def measure_rank(sizes=SIZES, budget_s: float = BUDGET_S) -> dict:
    """Run on every rank of a launched world: this rank's measurements, each the median of
    repetitions taken in alternation (bench.timing) for about `budget_s` seconds, so a slow
    phase of the machine hits every quantity alike."""
    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm = Comm(Mesh.build(Plan(dp=world)))
    device = comm.mesh.device   # what a training rank computes on (NCCL: device tensors only)
    n = 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.manual_seed(0)
    config = GPTConfig(**REFERENCE_GPT)
    model = GPT(config).to(device)
    x = torch.randint(0, config.vocab_size, (REFERENCE_BATCH, config.seq_len), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    big = torch.empty(32 * 2**20 // 4, device=device)
    dst = torch.empty_like(big)

    spec = from_gpt_config(config)

    def train_step(batch=x):
        model.zero_grad(set_to_none=False)
        model.loss(model(batch), batch).backward()

    train_step()   # the gradients AdamW's step needs
    small = x[:SMALL_BATCH].clone()
    work = {"matmul": (lambda: a @ b, 2 * n**3),
            "gpt": (train_step, step_flops(spec, REFERENCE_BATCH)),
            "gpt_small": (lambda: train_step(small), step_flops(spec, SMALL_BATCH)),
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
    return {"world": world, "matmul_flops": rate["matmul"], "model_flops": rate["gpt"],
            "model_flops_small": rate["gpt_small"], "mem_bw": rate["copy"], "optimizer_rate": rate["optimizer"], "reps": reps,
            "collectives": collectives}


def _waited(fn, device: torch.device):
    def run() -> None:
        fn()
        synchronize(device)
    return run


RATES = ("matmul_flops", "model_flops", "model_flops_small", "mem_bw", "optimizer_rate")


def combine(results: list[dict]) -> dict:
    """One launch's entry: the slowest rank's rates (the step waits for it)."""
    entry = {key: min(r[key] for r in results) for key in RATES}
    entry["collectives"] = {}
    for kind, curve in results[0]["collectives"].items():
        per_rank = [r["collectives"][kind]["busbw"] for r in results]
        entry["collectives"][kind] = {"sizes": curve["sizes"],
                                      "busbw": [min(col) for col in zip(*per_rank)]}
    return entry


def mean_of_rounds(entries: list[dict]) -> dict:
    """One world's entry from its rounds: each rate, and each point of each curve, the mean
    over the rounds. Each round is already a median (no single outlier moves it); the rounds
    fall in the machine's fast or slow phases, and the mean sits between them where a median
    of few rounds would pick one phase."""
    entry = {key: statistics.fmean(e[key] for e in entries) for key in RATES}
    entry["collectives"] = {
        kind: {"sizes": curve["sizes"],
               "busbw": [statistics.fmean(col) for col in
                         zip(*(e["collectives"][kind]["busbw"] for e in entries))]}
        for kind, curve in entries[0]["collectives"].items()}
    entry["per_round"] = {key: [e[key] for e in entries] for key in RATES}
    return entry
