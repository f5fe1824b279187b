"""`meshtrain plan --calibrate`: measure this machine and save the profile `--cluster local` uses.

On each world size asked for, every rank (one thread, all running at once, as in training)
measures: a square matmul's FLOP/s; a reference GPT step's achieved FLOP/s, its FLOPs
counted by the planner's own `step_flops` (so the time model's efficiency is calibrated on
the formula it uses); memory-copy bandwidth; and all_reduce, all_gather, reduce_scatter and
broadcast at several sizes through meshtrain's accounted `Comm` on the dp axis, converted to
bus bandwidth with the same ring factors the time model divides by (from 256 bytes, the size
of a step's statistics, to 16 MiB, near the 25 MiB DDP bucket); and AdamW's update rate
(parameters/s, PyTorch's CPU AdamW, tensor by tensor) on the reference GPT's parameters.

Runtime memory: then, per world size, the Trainer trains the reference GPT (DDP, AdamW,
fp32) at two micro-batch sizes, each in fresh processes, exactly as `--verify` runs a plan;
what each rank's resident memory grows by beyond the tensors the planner derives (exact
model states and saved activations from the Trainer's accounting, plus the planner's
backward transients) is the runtime's working memory: a fixed part (the first step's
thread pools, oneDNN and gloo buffers, glibc arenas) and a part that grows with the
activations (the allocator keeps the freed forward/backward temporaries as heap it does
not return). A line through the two points gives (fixed bytes, bytes per activation byte).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

SIZES = (256, 16 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20)   # bytes per collective
MEMORY_BATCHES = (2, 8)     # micro-batches of the runtime-memory calibration
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

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer_rate = n_params / _timed(opt.step, reps, sync)

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
            "optimizer_rate": optimizer_rate,
            "collectives": collectives, "comm_bytes_sent": comm.stats.total(tag="calibrate").sent}


def _combine(results: list[dict]) -> dict:
    """One entry per world: the slowest rank's rates (the step waits for it)."""
    entry = {key: min(r[key] for r in results)
             for key in ("matmul_flops", "model_flops", "mem_bw", "optimizer_rate")}
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
        profile["worlds"][str(w)]["runtime_memory"] = measure_runtime_memory(w)
    return profile


def measure_runtime_memory(world: int, batches=MEMORY_BATCHES) -> dict:
    """(fixed, per activation byte) of the runtime memory at `world` ranks; see the module
    docstring. Each batch size runs in fresh ranks: a heap already grown by an earlier run
    would hide the next run's growth."""
    from meshtrain.launch import launch
    from meshtrain.planner.verify import verify_rank

    points = []
    for b in batches:
        results = launch(verify_rank, nproc=world, args=(REFERENCE_GPT, {"dp": world}, b),
                         kwargs={"steps": 3, "warmup": 2, "alloc": False})
        acts = max(r["activations"] for r in results)
        tensors = max(r["model_states"] for r in results) + acts + _transient(b)
        points.append((acts, max(r["peak_growth"] for r in results) - tensors))
    (a0, o0), (a1, o1) = points[0], points[-1]
    per_act = max(0.0, (o1 - o0) / (a1 - a0)) if a1 != a0 else 0.0
    fixed = max(0.0, o0 - per_act * a0)
    return {"fixed": fixed, "per_activation_byte": per_act,
            "points": [{"activations": a, "overhead": o} for a, o in points]}


def _transient(micro_batch: int) -> float:
    """The planner's derived backward transients for the reference GPT (memory.transient_bytes)."""
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.planner.memory import transient_bytes
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.setup import Candidate, Setup

    spec = from_gpt_config(GPTConfig(**REFERENCE_GPT))
    return transient_bytes(spec, Candidate(Plan(), micro_batch), Setup(precision="fp32"))


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
                     f"({e['model_flops'] / e['matmul_flops']:.0%}), copy {fmt_rate(e['mem_bw'], 'B/s')}, "
                     f"AdamW {fmt_rate(e.get('optimizer_rate', 0), 'param/s')}")
        rt = e.get("runtime_memory")
        if rt:
            lines.append(f"      runtime memory: {rt['fixed'] / 1e6:.1f} MB + "
                         f"{rt['per_activation_byte']:.2f} x activations")
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
