"""Expert parallel against replicated experts on the same mixture of experts (a transformers
MoE preset): Plan(dp=W, ep=W) beside Plan(dp=W), every rank holding every expert, alternated
in one run from the same seed on the same batches.

Per side: the median step, the model-state bytes of the largest rank (ep holds E/ep experts
per layer), the bytes sent per rank per step by axis. For ep, the all-to-all against its
formula: each MoE layer moves tokens x top-k rows of hidden x 4 bytes each way (dispatch
and combine) forward and again backward (their gradients); the counters charge the rows
that leave the rank, so the measured bytes are the formula's times the share of rows the
step routed to other ranks (from the routed counts), reported beside it: what this rank's
own routed rows put on the wire, out and back, in forward and backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.bench.device import bench_device, fence
from meshtrain.bench.timing import alternate, median
from meshtrain.core.plan import Plan
from meshtrain.models.hf_presets import build, config_of
from meshtrain.train.trainer import Trainer

SEQ = 64
# this rank's routed rows on the wire: sent out (dispatch), back in (combine), and the
# same two ways again in backward (their gradients)
DIRECTIONS = {"ep-dispatch": "sent", "ep-combine": "received", "ep-dispatch-grad": "received",
              "ep-combine-grad": "sent"}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def ep_rank(model: str, global_batch: int, steps: int, reps: int, warmup: int) -> dict:
    """On each rank: both sides built, their steps alternated; then one counted step each."""
    world, rank, device = dist.get_world_size(), dist.get_rank(), bench_device()
    config = config_of(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (global_batch, SEQ + 1), generator=g)
    mine = tokens[rank * global_batch // world:(rank + 1) * global_batch // world].to(device)
    x, y = mine[:, :-1], mine[:, 1:]
    sides = {}
    for name, plan in (("replicated", Plan(dp=world)), ("ep", Plan(dp=world, ep=world))):
        torch.manual_seed(0)
        sides[name] = Trainer(build(model), plan, optimizer=_adamw)
    times = alternate({n: (lambda t=t: t.step(x, y)) for n, t in sides.items()}, steps, reps,
                      warmup, sync=fence(device))
    out = {"times": times, "sent": {}, "state_bytes": {}}
    for name, trainer in sides.items():
        if name == "ep":
            trainer.sharding.routed()   # counts from the counted step only
        trainer.comm.stats.reset()
        trainer.step(x, y)
        stats = trainer.comm.stats
        out["sent"][name] = {axis: stats.total(axis=axis).sent for axis in ("dp", "ep", "edp")}
        out["state_bytes"][name] = trainer.memory_report().model_states
    routed = sides["ep"].sharding.routed()["layer_sent"]          # (layers, ep) rows
    row = config.hidden_size * 4
    out["all_to_all"] = {
        "formula": len(DIRECTIONS) * routed.sum().item() * row,    # every routed row
        "leaving": len(DIRECTIONS) * (routed.sum() - routed[:, rank].sum()).item() * row,
        "measured": sum(getattr(sides["ep"].comm.stats.total(axis="ep", op="all_to_all",
                                                             tag=tag), way)
                        for tag, way in DIRECTIONS.items())}
    states = [s.full_state_dict() for s in sides.values()]
    out["max_param_diff"] = max((a - states[1][k]).abs().max().item()
                                for k, a in states[0].items())
    return out


def run(worlds=(2, 4), model: str = "mixtral-tiny", global_batch: int = 16, steps: int = 5,
        reps: int = 10, warmup: int = 3, progress=print) -> dict:
    from meshtrain.launch import launch

    result = {"model": model, "global_batch": global_batch, "seq": SEQ, "steps": steps,
              "reps": reps, "worlds": {}}
    for world in worlds:
        progress(f"world {world}: replicated experts and ep={world}, alternating ...")
        outs = launch(ep_rank, world, (model, global_batch, steps, reps, warmup))
        row = {name: {"step_s": median([t for o in outs for t in o["times"][name]]),
                      "state_bytes": max(o["state_bytes"][name] for o in outs),
                      "sent": {a: max(o["sent"][name][a] for o in outs)
                               for a in ("dp", "ep", "edp")}}
               for name in ("replicated", "ep")}
        row["ep"]["vs_replicated"] = row["ep"]["step_s"] / row["replicated"]["step_s"]
        result["worlds"][world] = {"sides": row, "all_to_all": [o["all_to_all"] for o in outs],
                                   "max_param_diff": max(o["max_param_diff"] for o in outs)}
    return result


def format_report(result: dict) -> str:
    lines = [f"model {result['model']}, global batch {result['global_batch']} x seq "
             f"{result['seq']}, AdamW; median step of {result['reps']} alternating "
             f"repetitions x {result['steps']} steps"]
    for world, w in result["worlds"].items():
        lines += [f"world {world} (parameters agree to {w['max_param_diff']:.1e})",
                  f"  {'side':<11} {'step':>9} {'/ replicated':>13} {'model states':>13} "
                  f"{'dp sent':>10} {'ep sent':>10} {'edp sent':>10}"]
        for name, s in w["sides"].items():
            sent = " ".join(f"{s['sent'][a] / 2**20:>7.2f}MiB" for a in ("dp", "ep", "edp"))
            lines.append(f"  {name:<11} {s['step_s'] * 1e3:>7.1f}ms "
                         f"{s.get('vs_replicated', 1.0):>13.3f} "
                         f"{s['state_bytes'] / 2**20:>10.2f}MiB {sent}")
        for rank, a in enumerate(w["all_to_all"]):
            lines.append(f"  rank {rank} all-to-all: formula {a['formula'] / 2**20:.3f} MiB "
                         f"(tokens x top-k x hidden x 4, each way, forward and backward), of "
                         f"which leaving the rank {a['leaving'] / 2**20:.3f} MiB; measured "
                         f"{a['measured'] / 2**20:.3f} MiB")
    lines.append("model states: the largest rank's parameters + gradients + optimizer states; "
                 "sent: bytes per rank per step (busiest rank)")
    return "\n".join(lines)
