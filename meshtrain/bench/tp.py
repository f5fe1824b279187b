"""Our tensor parallel against PyTorch's DTensor tensor parallel: same GPT, data, tp size.

In every rank, four contenders are built from the same seed: meshtrain's TP and DTensor's
(dtensor_tp.py), each without and with sequence parallel; their steps alternate (see
timing.py). Every rank feeds the whole global batch (tp ranks share one data shard). Per
contender the benchmark reports the median step, the tp collectives of one step (calls, and
bytes each rank sends, charged as a ring moves them, for both sides alike), the parameter
bytes this rank holds, and, as proof that both did the same work, the largest difference
between the two sides' full parameters after the same steps on the same data.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.bench.ddp import _adamw, _batch
from meshtrain.bench.device import basis_line, fence, flops_basis, throughput
from meshtrain.bench.timing import alternate, median
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.trainer import Trainer

SIDES = ("meshtrain", "dtensor")


def _param_bytes(params) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return sum(p.numel() * p.element_size() for p in local)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def tp_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int) -> dict:
    """On each rank: alternate the four contenders; seconds of every timed step, and each
    one's traffic, parameter bytes and agreement with its counterpart."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.bench import dtensor_tp

    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch(model_name, global_batch)
    ours, theirs, steppers = {}, {}, {}
    mesh = init_device_mesh(x.device.type, (world,), mesh_dim_names=("tp",))
    for sp in (False, True):
        suffix = "+sp" if sp else ""
        torch.manual_seed(0)
        trainer = Trainer(GPT(gpt_config(model_name)), Plan(tp=world, sequence_parallel=sp),
                          optimizer=_adamw)
        torch.manual_seed(0)
        model = dtensor_tp.parallelize_gpt(GPT(gpt_config(model_name)).to(x.device), mesh, sp)
        optimizer = _adamw(model.parameters())
        ours[sp], theirs[sp] = trainer, (model, optimizer)
        steppers[f"meshtrain{suffix}"] = lambda t=trainer: t.step(x, y)
        steppers[f"dtensor{suffix}"] = (lambda m=model, o=optimizer:
                                        dtensor_tp.train_step(m, o, x, y))
    times = alternate(steppers, steps, reps, warmup, sync=fence(x.device))
    out = {"times": times, "threads": torch.get_num_threads(), "contenders": {},
           "basis": flops_basis(model_name, x.device)}
    for sp in (False, True):
        suffix = "+sp" if sp else ""
        trainer, (model, optimizer) = ours[sp], theirs[sp]
        full = trainer.full_state_dict()
        diff = max((_full(p.detach()) - full[n]).abs().max().item()
                   for n, p in model.named_parameters())
        trainer.comm.stats.reset()
        trainer.step(x, y)
        traffic = trainer.comm.stats.total("tp")
        with dtensor_tp.counting(world, rank) as counted:
            dtensor_tp.train_step(model, optimizer, x, y)
        out["contenders"][f"meshtrain{suffix}"] = {
            "calls": traffic.calls, "sent": traffic.sent,
            "param_bytes": _param_bytes(trainer.model.parameters()), "max_param_diff": diff}
        out["contenders"][f"dtensor{suffix}"] = {
            "calls": counted.calls, "sent": counted.sent,
            "param_bytes": _param_bytes(model.parameters()), "max_param_diff": diff}
    return out


def run(worlds=(2, 4), model_name: str = "small", global_batch: int = 16, steps: int = 5,
        reps: int = 10, warmup: int = 3, progress=print) -> dict:
    """The whole benchmark; returns medians (seconds per step), traffic and ratios."""
    from meshtrain.launch import launch

    result = {"model": model_name, "global_batch": global_batch, "steps": steps, "reps": reps,
              "worlds": {}}
    for world in worlds:
        progress(f"tp={world}: meshtrain TP vs DTensor TP, with and without sequence parallel, "
                 "alternating ...")
        out = launch(tp_rank, world, (model_name, global_batch, steps, reps, warmup))[0]
        medians = {name: median(t) for name, t in out["times"].items()}
        entry = {"threads_per_rank": out["threads"], "contenders": {}}
        basis = result["basis"] = out["basis"]
        tokens = global_batch * gpt_config(model_name).seq_len   # one replica: all tp ranks
        for name, info in out["contenders"].items():
            entry["contenders"][name] = dict(info, step_s=medians[name],
                                             **throughput(medians[name], tokens, basis, world))
        for suffix in ("", "+sp"):
            entry[f"ratio{suffix}"] = medians[f"meshtrain{suffix}"] / medians[f"dtensor{suffix}"]
        entry["all_times"] = out["times"]
        result["worlds"][world] = entry
    return result


def format_report(result: dict) -> str:
    lines = [f"model {result['model']} GPT, global batch {result['global_batch']} on every tp "
             f"rank, median step of {result['reps']} alternating repetitions x "
             f"{result['steps']} steps each",
             f"{'tp':>3} {'contender':<13} {'step':>8} {'calls':>6} {'sent/step':>10} "
             f"{'params/rank':>12} {'param diff':>11} {'tokens/s':>9} {'MFU':>6}"]
    for world, w in result["worlds"].items():
        for name, c in w["contenders"].items():
            lines.append(f"{world:>3} {name:<13} {c['step_s'] * 1e3:>6.0f}ms {c['calls']:>6} "
                         f"{c['sent'] / 2**20:>6.2f} MiB {c['param_bytes'] / 2**20:>8.2f} MiB "
                         f"{c['max_param_diff']:>11.1e} {c['tokens_per_s']:>9,.0f} "
                         f"{c['mfu']:>6.2%}")
        lines.append(f"    ratio meshtrain / DTensor: {w['ratio']:.3f} (tp only), "
                     f"{w['ratio+sp']:.3f} (sequence parallel); {w['threads_per_rank']} "
                     f"thread(s) per rank")
    lines.append("sent/step = bytes each rank sends in one step's tp collectives, charged as a "
                 "ring moves them; param diff = max |ours - DTensor's| over full parameters "
                 "after the same steps")
    if "basis" in result:
        lines.append(basis_line(result["basis"]))
    return "\n".join(lines)
