"""`meshtrain plan --calibrate`: measure this machine and save the profile `--cluster local` uses.

On each world size asked for, every rank (one thread, all running at once, as in training)
measures: a square matmul's FLOP/s; a reference GPT step's achieved FLOP/s, its FLOPs
counted by the planner's own `step_flops` (so the time model's efficiency is calibrated on
the formula it uses); memory-copy bandwidth; and all_reduce, all_gather, reduce_scatter and
broadcast at several sizes through meshtrain's accounted `Comm` on the dp axis, converted to
bus bandwidth with the same ring factors the time model divides by (from 256 bytes, the size
of a step's statistics, to 16 MiB, near the 25 MiB DDP bucket); and AdamW's update rate
(parameters/s, PyTorch's CPU AdamW, tensor by tensor) on the reference GPT's parameters.

Timing on a noisy machine: within a launch every quantity is measured once per repetition,
in alternation, for a few seconds, and each is the median of its repetitions; each world
size is launched in several rounds interleaved with the others (1, 2, 4, 1, 2, 4, ...) and
the profile keeps the mean over rounds. The 2-core VM this was built on switches between
a fast and a slow phase (matmul 156 vs 127 GFLOP/s, phases of 5-20 s): one launch can sit
wholly in either, the rounds sample both.

Runtime memory: in each round, per world size, the Trainer trains the reference GPT (DDP, AdamW,
fp32) at two micro-batch sizes, each in fresh processes, exactly as `--verify` runs a plan;
what each rank's resident memory grows by beyond the tensors the planner derives (exact
model states and saved activations from the Trainer's accounting, plus the planner's
backward transients) is the runtime's working memory: a fixed part (the first step's
thread pools, oneDNN and gloo buffers, glibc arenas) and a part that grows with the
activations (the allocator keeps the freed forward/backward temporaries as heap it does
not return). A line through the two points (each the median over rounds) gives (fixed
bytes, bytes per activation byte).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

SIZES = (256, 16 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20)   # bytes per collective
ROUNDS = 4                  # launches per world size, interleaved with the other worlds'
BUDGET_S = 2.0              # seconds of alternated repetitions per launch
MIN_REPS = 5
MEMORY_BATCHES = (2, 8)     # micro-batches of the runtime-memory calibration
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
REFERENCE_GPT = dict(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256)


def measure_rank(sizes=SIZES, budget_s: float = BUDGET_S) -> dict:
    """Run on every rank of a launched world: this rank's measurements, each the median of
    repetitions taken in alternation (bench.timing) for about `budget_s` seconds, so a slow
    phase of the machine hits every quantity alike."""
    import torch
    import torch.distributed as dist

    from meshtrain.bench.timing import alternate
    from meshtrain.core.comm import Comm
    from meshtrain.core.mesh import Mesh
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.planner.hardware import ring_factor
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.time_model import step_flops

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm = Comm(Mesh.build(Plan(dp=world)))
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.manual_seed(0)
    config = GPTConfig(**REFERENCE_GPT)
    model = GPT(config)
    x = torch.randint(0, config.vocab_size, (8, config.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    big = torch.empty(32 * 2**20 // 4)
    dst = torch.empty_like(big)

    def train_step():
        model.zero_grad(set_to_none=False)
        model.loss(model(x), x).backward()

    train_step()   # the gradients AdamW's step needs
    work = {"matmul": (lambda: a @ b, 2 * n**3), "gpt": (train_step, step_flops(from_gpt_config(config), 8)),
            "optimizer": (opt.step, sum(p.numel() for p in model.parameters())),
            "copy": (lambda: dst.copy_(big), 2 * big.numel() * 4)}
    for kind in KINDS if world > 1 else ():
        for size in sizes:
            full = torch.ones(size // 4)
            shard = torch.ones(size // 4 // world)
            run = {"all_reduce": lambda f=full: comm.all_reduce(f, "dp", tag="calibrate"),
                   "all_gather": lambda f=full, s=shard: comm.all_gather(f[:s.numel() * world], s, "dp", tag="calibrate"),
                   "reduce_scatter": lambda f=full, s=shard: comm.reduce_scatter(s, f[:s.numel() * world], "dp", tag="calibrate"),
                   "broadcast": lambda f=full: comm.broadcast(f, 0, "dp", tag="calibrate")}[kind]
            work[f"{kind}:{size}"] = (run, ring_factor(kind, world) * size)   # bus bytes

    sync = comm.barrier if world > 1 else (lambda: None)
    start = time.perf_counter()
    for fn, _ in work.values():   # warm-up pass, which also sizes the repetitions
        sync()
        fn()
    # every rank must run the same collectives: all take the largest count any rank asks for
    reps = torch.tensor([max(MIN_REPS, math.ceil(budget_s / (time.perf_counter() - start)))])
    comm.all_reduce(reps, "dp", op="max", tag="calibrate")
    reps = int(reps.item())
    times = alternate({name: fn for name, (fn, _) in work.items()}, 1, reps, 0, sync,
                      wait_for_all=False)
    rate = {name: amount / statistics.median(times[name]) for name, (_, amount) in work.items()}
    collectives = {kind: {"sizes": list(sizes), "busbw": [rate[f"{kind}:{s}"] for s in sizes]}
                   for kind in KINDS if world > 1}
    return {"world": world, "matmul_flops": rate["matmul"], "model_flops": rate["gpt"],
            "mem_bw": rate["copy"], "optimizer_rate": rate["optimizer"], "reps": reps,
            "collectives": collectives}


RATES = ("matmul_flops", "model_flops", "mem_bw", "optimizer_rate")


def _combine(results: list[dict]) -> dict:
    """One launch's entry: the slowest rank's rates (the step waits for it)."""
    entry = {key: min(r[key] for r in results) for key in RATES}
    entry["collectives"] = {}
    for kind, curve in results[0]["collectives"].items():
        per_rank = [r["collectives"][kind]["busbw"] for r in results]
        entry["collectives"][kind] = {"sizes": curve["sizes"],
                                      "busbw": [min(col) for col in zip(*per_rank)]}
    return entry


def _mean_of_rounds(entries: list[dict]) -> dict:
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


def calibrate(worlds=(1, 2, 4), rounds: int = ROUNDS, budget_s: float = BUDGET_S,
              progress: bool = True) -> dict:
    """Measure every world size in `rounds` rounds (1, 2, 4, 1, 2, 4, ...): this machine's
    speed drifts between phases lasting seconds (a 2-core cloud VM here: +-10%), and rounds
    spread each world's samples over the whole calibration instead of one phase. Each round
    also measures the runtime-memory points."""
    from tqdm import tqdm

    from meshtrain.launch import launch

    profile = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
               "host_mem": _host_mem(), "worlds": {}}
    rates: dict[int, list[dict]] = {w: [] for w in worlds}
    memory: dict[int, list[list[tuple[float, float]]]] = {w: [] for w in worlds}
    bar = tqdm(total=rounds * len(worlds) * (1 + len(MEMORY_BATCHES)), unit="run",
               desc="calibrating", disable=not progress, file=sys.stderr)
    for _ in range(rounds):
        for w in worlds:
            rates[w].append(_combine(launch(measure_rank, nproc=w, kwargs={"budget_s": budget_s})))
            bar.update()
            memory[w].append([runtime_memory_point(w, b) for b in MEMORY_BATCHES])
            bar.update(len(MEMORY_BATCHES))
    bar.close()
    for w in worlds:
        entry = _mean_of_rounds(rates[w])
        entry["runtime_memory"] = fit_runtime_memory(memory[w])
        profile["worlds"][str(w)] = entry
    return profile


def runtime_memory_point(world: int, batch: int) -> tuple[float, float]:
    """(activation bytes, runtime memory) of the reference GPT at `batch` on `world` ranks,
    in fresh ranks (a heap already grown by an earlier run would hide this run's growth),
    run exactly as `--verify` runs a plan; see the module docstring."""
    from meshtrain.launch import launch
    from meshtrain.planner.verify import verify_rank

    results = launch(verify_rank, nproc=world, args=(REFERENCE_GPT, {"dp": world}, batch),
                     kwargs={"steps": 2, "alloc": False})
    acts = max(r["activations"] for r in results)
    tensors = max(r["model_states"] for r in results) + acts + _transient(batch)
    return acts, max(r["peak_growth"] for r in results) - tensors


def fit_runtime_memory(rounds: list[list[tuple[float, float]]]) -> dict:
    """(fixed, per activation byte): a line through the first and last batch's points, each
    the median over the rounds (one run's heap growth varies by a few MB)."""
    points = [(statistics.median(a for a, _ in col), statistics.median(o for _, o in col))
              for col in zip(*rounds)]
    (a0, o0), (a1, o1) = points[0], points[-1]
    per_act = max(0.0, (o1 - o0) / (a1 - a0)) if a1 != a0 else 0.0
    fixed = max(0.0, o0 - per_act * a0)
    return {"fixed": fixed, "per_activation_byte": per_act,
            "points": [{"activations": a, "overhead": o} for a, o in points],
            "per_round": [[o for _, o in r] for r in rounds]}


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
    print(f"calibrating on {worlds} local rank(s), {ROUNDS} rounds of about {BUDGET_S:g} s "
          f"each, with the runtime memory (about two minutes)...", file=sys.stderr)
    profile = calibrate(tuple(worlds))
    path = save_profile(profile, args.profile)
    print(describe(profile))
    print(f"profile saved to {path}; plan with it: meshtrain plan --cluster local ...")
    return 0
