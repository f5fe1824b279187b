"""ZeRO-1, -2 and -3 (ours) against our DDP, torch's ZeRO-1 (ZeroRedundancyOptimizer over
torch DDP) and torch's ZeRO-3 (FSDP2, `fully_shard` on each layer and the root): same model,
data and world size, alternating in one run.

Per side and rank: the median step time, the model-state bytes held (parameters, gradients,
optimizer states), and the bytes sent per step. Ours are counted by `Comm`; torch's are
charged by the same rules from what it does (ring all-reduce of every gradient; each
parameter broadcast from the rank that owns it after the step; FSDP2: every layer gathered
in forward and again in backward but the root, gradients reduce-scattered). All sides start from the
same seed and train on the same batches, so their parameters must agree to round-off at the
end: the benchmark reports the largest difference as proof the sides did the same work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.bench.ddp import _adamw, _batch
from meshtrain.bench.device import basis_line, fence, flops_basis, throughput
from meshtrain.bench.timing import alternate, median
from meshtrain.core.comm import ring_all_reduce_elements, ring_half_elements
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.trainer import Trainer

OURS = {"DDP": {}, "ZeRO-1": {"zero": 1}, "ZeRO-2": {"zero": 2}, "ZeRO-3": {"zero": 3}}
PEER = "torch ZeRO-1"
FSDP = "torch FSDP2"
SIDES = (*OURS, PEER, FSDP)


def _ours(model_name: str, world: int, plan_kw: dict, x, y):
    torch.manual_seed(0)
    trainer = Trainer(GPT(gpt_config(model_name)), Plan(dp=world, **plan_kw), optimizer=_adamw)

    def bytes_per_step() -> int:
        trainer.comm.stats.reset()
        trainer.step(x, y)
        return trainer.comm.stats.total().sent

    def state() -> int:
        return trainer.memory_report().model_states

    def parameters():
        return trainer.full_state_dict().values()

    return (lambda: trainer.step(x, y)), bytes_per_step, state, parameters


def _peer(model_name: str, world: int, x, y):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = GPT(gpt_config(model_name)).to(x.device)
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(ddp(x), y).backward()
        opt.step()

    def bytes_per_step() -> int:
        step()
        rank, params = dist.get_rank(), list(model.parameters())
        grads = sum(ring_all_reduce_elements(p.numel(), world, rank) * 4 for p in params)
        owned = sum(p.numel() * 4 for p in params if opt._param_to_rank[p] == rank)
        return grads + (world - 1) * owned   # a broadcast charges its root (N-1) x size

    def state() -> int:
        params = list(model.parameters())
        return (storage_bytes(params) + storage_bytes([p.grad for p in params if p.grad is not None])
                + storage_bytes(optimizer_state_tensors(opt.optim)))

    return step, bytes_per_step, state, lambda: model.state_dict().values()


def _fsdp(model_name: str, world: int, x, y):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(gpt_config(model_name)).to(x.device)   # FSDP2 shards on the default mesh's device
    layers = model.layers()
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    opt = _adamw(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()
        opt.step()

    def bytes_per_step() -> int:
        step()
        rank = dist.get_rank()
        half = lambda n: ring_half_elements(n, world, rank) * 4
        # each layer gathered before its forward and again before its backward (the last
        # one's kept), gradients reduce-scattered once
        return sum(2 * half(n) + half(n) for n in sizes) - half(sizes[-1])

    def state() -> int:
        params = [p.to_local() for p in model.parameters()]
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        states = [v.to_local() if hasattr(v, "to_local") else v
                  for v in optimizer_state_tensors(opt)]
        return storage_bytes(params) + storage_bytes(grads) + storage_bytes(states)

    return step, bytes_per_step, state, lambda: [v.full_tensor() for v in model.state_dict().values()]


def zero_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int,
              order: list[str]) -> dict:
    """On each rank: build the sides in `order`, alternate their steps; per side the step
    times, the bytes sent in one step, the model-state bytes, and the parameters' spread."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch(model_name, global_batch)
    per_rank = global_batch // world
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    build = {PEER: _peer, FSDP: _fsdp}
    sides = {name: (_ours(model_name, world, OURS[name], x, y) if name in OURS
                    else build[name](model_name, world, x, y)) for name in order}
    times = alternate({name: side[0] for name, side in sides.items()}, steps, reps, warmup,
                      sync=fence(x.device))
    sent = {name: side[1]() for name, side in sides.items()}   # one more step each
    states = {name: side[2]() for name, side in sides.items()}
    weights = {name: list(side[3]()) for name, side in sides.items()}
    reference = weights[order[0]]
    diff = max((a - b).abs().max().item() for w in weights.values()
               for a, b in zip(reference, w))
    return {"times": times, "sent": sent, "state_bytes": states, "max_param_diff": diff,
            "basis": flops_basis(model_name, x.device)}


def run(worlds=(2, 4), model_name: str = "small", global_batch: int = 16, steps: int = 5,
        reps: int = 10, warmup: int = 3, progress=print) -> dict:
    """Two launches per world, the sides built in opposite orders (the model built first in
    a process runs a few percent slower: docs/history.md), their steps pooled."""
    from meshtrain.launch import launch

    result = {"model": model_name, "global_batch": global_batch, "steps": steps, "reps": reps,
              "worlds": {}}
    for world in worlds:
        progress(f"world {world}: {', '.join(SIDES)}, alternating, in two launches ...")
        outs = [launch(zero_rank, world, (model_name, global_batch, steps, (reps + 1) // 2,
                                          warmup, list(order)))
                for order in (SIDES, SIDES[::-1])]
        row = {}
        basis = result["basis"] = outs[0][0]["basis"]
        tokens = global_batch * gpt_config(model_name).seq_len
        for name in SIDES:
            times = [t for out in outs for t in out[0]["times"][name]]
            row[name] = {"step_s": median(times),
                         **throughput(median(times), tokens, basis, world),
                         "state_bytes": max(r["state_bytes"][name] for r in outs[0]),
                         "sent_per_step": max(r["sent"][name] for r in outs[0])}
        ddp, peer, fsdp = (row[k]["step_s"] for k in ("DDP", PEER, FSDP))
        for name in SIDES:
            row[name]["vs_our_ddp"] = row[name]["step_s"] / ddp
            row[name]["vs_torch_zero1"] = row[name]["step_s"] / peer
            row[name]["vs_fsdp2"] = row[name]["step_s"] / fsdp
        result["worlds"][world] = {
            "sides": row, "max_param_diff": max(r["max_param_diff"] for out in outs for r in out)}
    return result


def format_report(result: dict) -> str:
    lines = [f"model {result['model']} GPT, global batch {result['global_batch']}, AdamW; median "
             f"step of {result['reps']} alternating repetitions x {result['steps']} steps"]
    for world, w in result["worlds"].items():
        lines += [f"world {world} (parameters agree to {w['max_param_diff']:.1e})",
                  f"  {'side':<14} {'step':>9} {'/ our DDP':>10} {'/ torch ZeRO-1':>15} "
                  f"{'/ FSDP2':>8} {'model states':>13} {'sent / step':>12} {'tokens/s':>9} "
                  f"{'MFU':>6}"]
        for name, s in w["sides"].items():
            lines.append(f"  {name:<14} {s['step_s'] * 1e3:>7.0f}ms {s['vs_our_ddp']:>10.3f} "
                         f"{s['vs_torch_zero1']:>15.3f} {s['vs_fsdp2']:>8.3f} "
                         f"{s['state_bytes'] / 2**20:>10.2f}MiB "
                         f"{s['sent_per_step'] / 2**20:>9.2f}MiB {s['tokens_per_s']:>9,.0f} "
                         f"{s['mfu']:>6.2%}")
    lines.append("model states: the largest rank's parameters + gradients + optimizer states; "
                 "sent: bytes per rank per step (busiest rank)")
    if "basis" in result:
        lines.append(basis_line(result["basis"]))
    return "\n".join(lines)
