"""`meshtrain plan --calibrate`: measure this machine and save the profile `--cluster local` uses.

On each world size asked for, every rank (one thread, all running at once, as in training)
measures: a square matmul's FLOP/s; a reference GPT step's achieved FLOP/s, its FLOPs
counted by the planner's own `step_flops` (so the time model's efficiency is calibrated on
the formula it uses); memory-copy bandwidth; and all_reduce, all_gather, reduce_scatter and
broadcast at several sizes through meshtrain's accounted `Comm` on the dp axis, converted to
bus bandwidth with the same ring factors the time model divides by.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

SIZES = (16 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20)   # bytes per collective
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
REFERENCE_GPT = dict(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256)


def _timed(fn, reps: int, sync=None) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up; `sync` aligns ranks."""
    fn()
    times = []
    for _ in range(reps):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rank(sizes=SIZES, reps: int = 5) -> dict:
    """Run on every rank of a launched world: this rank's measurements."""
    import torch
    import torch.distributed as dist

    from meshtrain.core.comm import Comm
    from meshtrain.core.mesh import Mesh
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.time_model import step_flops

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm = Comm(Mesh.build(Plan(dp=world)))
    sync = (lambda: comm.barrier()) if world > 1 else None
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    matmul = 2 * n**3 / _timed(lambda: a @ b, reps * 4, sync)

    torch.manual_seed(0)
    config = GPTConfig(**REFERENCE_GPT)
    model = GPT(config)
    x = torch.randint(0, config.vocab_size, (8, config.seq_len))

    def train_step():
        model.zero_grad(set_to_none=False)
        model.loss(model(x), x).backward()
    model_rate = step_flops(from_gpt_config(config), 8) / _timed(train_step, reps, sync)

    big = torch.empty(32 * 2**20 // 4)
    dst = torch.empty_like(big)
    mem_bw = 2 * big.numel() * 4 / _timed(lambda: dst.copy_(big), reps, sync)

    collectives = {}
    if world > 1:
        factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
                  "reduce_scatter": (world - 1) / world, "broadcast": 1.0}
        for kind in KINDS:
            busbw = []
            for size in sizes:
                full = torch.ones(size // 4)
                shard = torch.ones(size // 4 // world)
                run = {"all_reduce": lambda: comm.all_reduce(full, "dp", tag="calibrate"),
                       "all_gather": lambda: comm.all_gather(full[:shard.numel() * world], shard, "dp", tag="calibrate"),
                       "reduce_scatter": lambda: comm.reduce_scatter(shard, full[:shard.numel() * world], "dp", tag="calibrate"),
                       "broadcast": lambda: comm.broadcast(full, 0, "dp", tag="calibrate")}[kind]
                t = _timed(run, reps, sync)
                busbw.append(factor[kind] * size / t)
            collectives[kind] = {"sizes": list(sizes), "busbw": busbw}
    return {"world": world, "matmul_flops": matmul, "model_flops": model_rate, "mem_bw": mem_bw,
            "collectives": collectives, "comm_bytes_sent": comm.stats.total(tag="calibrate").sent}


def _combine(results: list[dict]) -> dict:
    """One entry per world: the slowest rank's rates (the step waits for it)."""
    entry = {key: min(r[key] for r in results) for key in ("matmul_flops", "model_flops", "mem_bw")}
    entry["collectives"] = {}
    for kind, curve in results[0]["collectives"].items():
        per_rank = [r["collectives"][kind]["busbw"] for r in results]
        entry["collectives"][kind] = {"sizes": curve["sizes"],
                                      "busbw": [min(col) for col in zip(*per_rank)]}
    return entry


def calibrate(worlds=(1, 2, 4), reps: int = 5) -> dict:
    from meshtrain.launch import launch

    profile = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
               "host_mem": _host_mem(), "worlds": {}}
    for w in worlds:
        results = launch(measure_rank, nproc=w, kwargs={"reps": reps})
        profile["worlds"][str(w)] = _combine(results)
    return profile


def _host_mem() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16e9


def describe(profile: dict) -> str:
    from meshtrain.planner.units import fmt_rate
    lines = [f"calibrated {profile['created']} on {profile['cpu_count']} cores, "
             f"{profile['host_mem'] / 1e9:.3g} GB host memory"]
    for w, e in profile["worlds"].items():
        lines.append(f"  {w} rank(s): matmul {fmt_rate(e['matmul_flops'], 'FLOP/s')} per rank, "
                     f"GPT step {fmt_rate(e['model_flops'], 'FLOP/s')} "
                     f"({e['model_flops'] / e['matmul_flops']:.0%}), copy {fmt_rate(e['mem_bw'], 'B/s')}")
        for kind, c in e["collectives"].items():
            pts = ", ".join(f"{s / 2**20:g} MiB {fmt_rate(b, 'B/s')}" for s, b in zip(c["sizes"], c["busbw"]))
            lines.append(f"      {kind}: {pts}")
    return "\n".join(lines)


def calibrate_command(args) -> int:
    from meshtrain.planner.profile import save_profile
    worlds = sorted({1, 2, max(1, args.nproc)} | ({4} if args.nproc >= 4 else set()))
    print(f"calibrating on {worlds} local rank(s)...", file=sys.stderr)
    profile = calibrate(tuple(worlds))
    path = save_profile(profile, args.profile)
    print(describe(profile))
    print(f"profile saved to {path}; plan with it: meshtrain plan --cluster local ...")
    return 0
