"""Our DDP against torch.nn.parallel.DistributedDataParallel: same model, data, world size.

In every rank both contenders are built from the same seed and train on the same batch; their
steps alternate (see timing.py). Beside them, one process (1 thread, then all cores) at the
same global batch gives the scaling of each. After timing, both replicas have taken the same
number of steps on the same data, so their parameters must agree to round-off: the benchmark
reports that difference as proof the two did the same work.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from meshtrain.bench.device import (basis_line, bench_device, fence, flops_basis, gpt_batch,
                                    throughput)
from meshtrain.bench.timing import alternate, median
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.trainer import Trainer


def _batch(model_name: str, batch: int, seed: int = 0):
    """The benchmark's batch, on this rank's device."""
    return gpt_batch(model_name, batch, bench_device(), seed)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def ddp_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int,
             bucket_mb: float, ours_first: bool) -> dict:
    """On each rank: alternate our DDP and torch's; returns seconds of every timed step.

    The model built first in a process runs a few percent slower (docs/history.md), so
    `run` builds them in both orders, in two launches, and pools the steps."""
    from torch.nn.parallel import DistributedDataParallel

    world, rank, device = dist.get_world_size(), dist.get_rank(), bench_device()
    x, y = _batch(model_name, global_batch)
    per_rank = global_batch // world
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]

    def build_ours():
        torch.manual_seed(0)
        return Trainer(GPT(gpt_config(model_name)), Plan(dp=world, bucket_mb=bucket_mb),
                       optimizer=_adamw)

    def build_theirs():
        torch.manual_seed(0)
        model = GPT(gpt_config(model_name)).to(device)
        return model, DistributedDataParallel(model)

    if ours_first:
        ours = build_ours()
        model, theirs = build_theirs()
    else:
        model, theirs = build_theirs()
        ours = build_ours()
    optimizer = _adamw(theirs.parameters())

    def torch_step():
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(theirs(x), y)
        loss.backward()
        optimizer.step()

    times = alternate({"meshtrain": lambda: ours.step(x, y), "torch": torch_step},
                      steps, reps, warmup, sync=fence(device))
    diff = max((a - b).abs().max().item() for a, b in
               zip(ours.model.parameters(), model.parameters()))
    return {"times": times, "max_param_diff": diff, "threads": torch.get_num_threads(),
            "basis": flops_basis(model_name, device)}


def one_process_rank(model_name: str, global_batch: int, steps: int, reps: int,
                     warmup: int) -> dict:
    """One process, the whole global batch, plain training: 1 thread, then every core."""
    x, y = _batch(model_name, global_batch)
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name)).to(x.device)
    optimizer = _adamw(model.parameters())

    def step():
        optimizer.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()
        optimizer.step()

    out = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        out[threads] = alternate({"one": step}, steps, reps, warmup,
                                 sync=fence(x.device, barrier=False))["one"]
    return out


def run(worlds=(2, 4), model_name: str = "small", global_batch: int = 16, steps: int = 5,
        reps: int = 10, warmup: int = 3, bucket_mb: float = Plan().bucket_mb,
        progress=print) -> dict:
    """The whole benchmark; returns medians (seconds per step) and ratios."""
    from meshtrain.launch import launch

    progress(f"one process, global batch {global_batch}, {model_name} GPT ...")
    single = launch(one_process_rank, 1, (model_name, global_batch, steps, reps, warmup))[0]
    result = {"model": model_name, "global_batch": global_batch, "steps": steps, "reps": reps,
              "one_process": {f"{t}_threads": median(v) for t, v in single.items()},
              "worlds": {}}
    t1 = result["one_process"]["1_threads"]
    for world in worlds:
        progress(f"world {world}: meshtrain DDP vs torch DDP, alternating, each built first "
                 "in one of two launches ...")
        outs = [launch(ddp_rank, world, (model_name, global_batch, steps, (reps + 1) // 2,
                                         warmup, bucket_mb, ours_first))[0]
                for ours_first in (True, False)]
        times = {side: [t for out in outs for t in out["times"][side]]
                 for side in ("meshtrain", "torch")}
        ours, theirs = median(times["meshtrain"]), median(times["torch"])
        basis = result["basis"] = outs[0]["basis"]
        tokens = global_batch * gpt_config(model_name).seq_len
        result["worlds"][world] = {
            "meshtrain": throughput(ours, tokens, basis, world),
            "torch": throughput(theirs, tokens, basis, world),
            "meshtrain_s": ours, "torch_s": theirs, "ratio": ours / theirs,
            "meshtrain_scaling": t1 / ours, "torch_scaling": t1 / theirs,
            "threads_per_rank": outs[0]["threads"],
            "max_param_diff": max(out["max_param_diff"] for out in outs), "all_times": times}
    return result


def format_report(result: dict) -> str:
    one = result["one_process"]
    lines = [f"model {result['model']} GPT, global batch {result['global_batch']}, median step "
             f"of {result['reps']} alternating repetitions x {result['steps']} steps each",
             "one process: " + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.0f} ms"
                                         for k, v in one.items()),
             f"{'world':>5} {'meshtrain':>10} {'torch DDP':>10} {'ratio':>6} "
             f"{'scaling ours':>13} {'scaling torch':>14} {'param diff':>11} "
             f"{'tokens/s ours':>14} {'torch':>9} {'MFU ours':>9} {'torch':>6}"]
    for world, w in result["worlds"].items():
        ours, theirs = w["meshtrain"], w["torch"]
        lines.append(f"{world:>5} {w['meshtrain_s'] * 1e3:>8.0f}ms {w['torch_s'] * 1e3:>8.0f}ms "
                     f"{w['ratio']:>6.3f} {w['meshtrain_scaling']:>12.2f}x "
                     f"{w['torch_scaling']:>13.2f}x {w['max_param_diff']:>11.1e} "
                     f"{ours['tokens_per_s']:>14,.0f} {theirs['tokens_per_s']:>9,.0f} "
                     f"{ours['mfu']:>9.2%} {theirs['mfu']:>6.2%}")
    lines.append("ratio = meshtrain / torch step time (< 1: ours faster); scaling = one "
                 "1-thread process / world")
    if "basis" in result:
        lines.append(basis_line(result["basis"]))
    return "\n".join(lines)
