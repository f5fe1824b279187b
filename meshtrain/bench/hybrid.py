"""Every 8-rank plan of the small GPT (dp x pp x tp, and 3D + ZeRO-1) side by side, with
PyTorch's own composition where one exists without pipelining: FSDP2 (`fully_shard` over dp)
on DTensor tensor parallel (over tp), the 2D mesh torchtitan builds.

All contenders live in one launch of 8 ranks and alternate their steps (timing.py); each
rank feeds its replica's shard of the same global batch. Per contender: the median step and
the model-state bytes (parameters, gradients, optimizer states) of the busiest and the
lightest rank. Where torch's FSDP2 (ZeRO-3) runs, our ZeRO-3 on the same dp x tp mesh runs
beside it.
"""
from __future__ import annotations

import torch

from meshtrain.bench.ddp import _adamw, _batch
from meshtrain.bench.device import basis_line, fence, flops_basis, throughput
from meshtrain.bench.timing import alternate, median
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.trainer import Trainer

WORLD = 8
MICROBATCHES = 4   # with pp > 1


def plans(n_layers: int, n_head: int) -> list[dict]:
    """Every (dp, pp, tp) of 8 ranks the GPT can take (pp stages <= its layers, tp dividing
    its heads), then the classic 3D + ZeRO-1."""
    out = []
    for pp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            if WORLD % (pp * tp) or pp > n_layers or n_head % tp:
                continue
            out.append(dict(dp=WORLD // (pp * tp), pp=pp, tp=tp,
                            microbatches=MICROBATCHES if pp > 1 else 1))
    return out + [dict(dp=2, pp=2, tp=2, zero=1, microbatches=MICROBATCHES)]


def name(plan: dict) -> str:
    zero = f" z{plan['zero']}" if plan.get("zero") else ""
    return f"dp{plan['dp']} pp{plan['pp']} tp{plan['tp']}{zero}"


def _shard(x, y, dp_rank: int, dp_size: int):
    per = x.size(0) // dp_size
    return x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]


def _ours(model_name: str, plan: dict, x, y):
    torch.manual_seed(0)
    trainer = Trainer(GPT(gpt_config(model_name)), Plan(**plan), optimizer=_adamw)
    x, y = _shard(x, y, trainer.dp_rank, trainer.dp_size)
    return (lambda: trainer.step(x, y)), (lambda: trainer.memory_report().model_states)


def _torch(model_name: str, dp: int, tp: int, x, y):
    """FSDP2 over dp on DTensor TP over tp (tp contiguous, as ours)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshtrain.bench import dtensor_tp

    mesh = init_device_mesh(x.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name)).to(x.device)
    if tp > 1:
        dtensor_tp.parallelize_gpt(model, mesh["tp"], False)
    for layer in model.layers():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = _adamw(model.parameters())
    x, y = _shard(x, y, mesh["dp"].get_local_rank(), dp)

    def state() -> int:
        local = lambda ts: [t.to_local() if hasattr(t, "to_local") else t for t in ts]
        params = list(model.parameters())
        return (storage_bytes(local(params)) + storage_bytes(local(p.grad for p in params
                                                                    if p.grad is not None))
                + storage_bytes(local(optimizer_state_tensors(optimizer))))

    return (lambda: dtensor_tp.train_step(model, optimizer, x, y)), state


def hybrid_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int) -> dict:
    cfg = gpt_config(model_name)
    x, y = _batch(model_name, global_batch)
    sides = {}
    for plan in plans(cfg.n_layer + 2, cfg.n_head):
        sides[name(plan)] = _ours(model_name, plan, x, y)
        if plan["pp"] == 1 and not plan.get("zero"):
            # FSDP2 shards parameters too: beside it, our ZeRO-3 on the same mesh
            zero3 = dict(plan, zero=3)
            sides[name(zero3)] = _ours(model_name, zero3, x, y)
            sides[f"torch FSDP2+TP dp{plan['dp']} tp{plan['tp']}"] = _torch(
                model_name, plan["dp"], plan["tp"], x, y)
    times = alternate({n: s[0] for n, s in sides.items()}, steps, reps, warmup,
                      sync=fence(x.device))
    return {"times": times, "state_bytes": {n: s[1]() for n, s in sides.items()},
            "basis": flops_basis(model_name, x.device)}


def run(model_name: str = "small", global_batch: int = 16, steps: int = 3, reps: int = 3,
        warmup: int = 2, progress=print) -> dict:
    from meshtrain.launch import launch

    progress(f"{WORLD} ranks: every dp x pp x tp plan and torch FSDP2 + DTensor TP, "
             "alternating ...")
    per_rank = launch(hybrid_rank, WORLD, (model_name, global_batch, steps, reps, warmup))
    rows, basis = {}, per_rank[0]["basis"]
    tokens = global_batch * gpt_config(model_name).seq_len
    for n in per_rank[0]["times"]:
        state = [r["state_bytes"][n] for r in per_rank]
        step_s = median(per_rank[0]["times"][n])
        rows[n] = {"step_s": step_s, "state_max": max(state), "state_min": min(state),
                   **throughput(step_s, tokens, basis, WORLD)}
    return {"model": model_name, "global_batch": global_batch, "steps": steps, "reps": reps,
            "rows": rows, "basis": basis}


def format_report(result: dict) -> str:
    lines = [f"model {result['model']} GPT, {WORLD} ranks, global batch "
             f"{result['global_batch']}, M={MICROBATCHES} with pp > 1, median step of "
             f"{result['reps']} alternating repetitions x {result['steps']} steps",
             f"{'plan':<26} {'step':>8} {'model states/rank (max, min)':>30} {'tokens/s':>9} "
             f"{'MFU':>6}"]
    for n, r in result["rows"].items():
        lines.append(f"{n:<26} {r['step_s'] * 1e3:>6.0f}ms {r['state_max'] / 2**20:>12.2f} MiB "
                     f"{r['state_min'] / 2**20:>8.2f} MiB {r['tokens_per_s']:>9,.0f} "
                     f"{r['mfu']:>6.2%}")
    lines.append("model states = parameters + gradients + AdamW states this rank holds")
    if "basis" in result:
        lines.append(basis_line(result["basis"]))
    return "\n".join(lines)
