"""`meshtrain plan --calibrate`: measure this machine and save the profile `--cluster local` uses.

On each world size asked for, every rank (one thread, all running at once, as in training)
measures: a square matmul's FLOP/s; a reference GPT step's achieved FLOP/s, its FLOPs
counted by the planner's own `step_flops` (so the time model's efficiency is calibrated on
the formula it uses), at two batch sizes (their difference separates the fixed cost of a
micro-batch from its FLOPs); memory-copy bandwidth; and all_reduce, all_gather,
reduce_scatter, broadcast and point-to-point send/recv at several sizes through meshtrain's accounted `Comm` on the dp axis, converted to
bus bandwidth with the same ring factors the time model divides by (from 256 bytes, the size
of a step's statistics, to 16 MiB, near the 25 MiB DDP bucket); and AdamW's update rate
(parameters/s, PyTorch's CPU AdamW, tensor by tensor) on the reference GPT's parameters.

Timing on a noisy machine: within a launch every quantity is measured once per repetition,
in alternation, for a few seconds, and each is the median of its repetitions; each world
size is launched in several rounds interleaved with the others (1, 2, 4, 1, 2, 4, ...) and
the profile keeps the mean over rounds. A shared machine's speed can switch between a fast
and a slow phase lasting seconds: one launch can sit wholly in either, the rounds sample both
(docs/history.md).

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

import itertools
import math
import os
import statistics
import sys
import time

SIZES = (256, 16 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20)   # bytes per collective
ROUNDS = 5                  # launches per world size, interleaved with the other worlds'
BUDGET_S = 2.0              # seconds of alternated repetitions per launch
MIN_REPS = 5
MEMORY_BATCHES = (2, 16)    # micro-batches of the runtime-memory calibration on the reference
                            # GPT (far apart: a few MB of noise in a point moves a slope less)
DEEP_POINT = (4, 8)         # ... and (layers, batch) of a deeper one: the heap keeps more of
                            # a micro-batch's first layer than of each further layer's
ACCUMULATION_POINT = (16, 2)   # ... and (batch, micro-batches) of one that accumulates
                            # gradients over micro-batches: its heap keeps more
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
REFERENCE_GPT = dict(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256)
REFERENCE_BATCH, SMALL_BATCH = 8, 2   # the reference step at two sizes: its rate and its
                                      # fixed cost per micro-batch (profile.step_costs)
# the runtime-memory runs in calibration order, (layers, batch, micro-batches): the reference
# GPT at MEMORY_BATCHES, the deeper one, the accumulating one (fit_runtime_memory and
# fit_trainer read them in this order)
MEMORY_RUNS = ([(REFERENCE_GPT["n_layer"], b, 1) for b in MEMORY_BATCHES] + [(*DEEP_POINT, 1)]
               + [(REFERENCE_GPT["n_layer"], *ACCUMULATION_POINT)])


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
    x = torch.randint(0, config.vocab_size, (REFERENCE_BATCH, config.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    big = torch.empty(32 * 2**20 // 4)
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
            full = torch.ones(size // 4)
            shard = torch.ones(size // 4 // world)
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
    # every rank must run the same collectives: all take the largest count any rank asks for
    reps = torch.tensor([max(MIN_REPS, math.ceil(budget_s / (time.perf_counter() - start)))])
    comm.all_reduce(reps, "dp", op="max", tag="calibrate")
    reps = int(reps.item())
    times = alternate({name: fn for name, (fn, _) in work.items()}, 1, reps, 0, sync,
                      wait_for_all=False)
    rate = {name: amount / max(statistics.median(times[name]), 1e-9)
            for name, (_, amount) in work.items()}
    collectives = {kind: {"sizes": list(sizes), "busbw": [rate[f"{kind}:{s}"] for s in sizes]}
                   for kind in KINDS if world > 1}
    return {"world": world, "matmul_flops": rate["matmul"], "model_flops": rate["gpt"],
            "model_flops_small": rate["gpt_small"], "mem_bw": rate["copy"], "optimizer_rate": rate["optimizer"], "reps": reps,
            "collectives": collectives}


RATES = ("matmul_flops", "model_flops", "model_flops_small", "mem_bw", "optimizer_rate")


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
    speed may drift between phases lasting seconds (docs/history.md), and rounds
    spread each world's samples over the whole calibration instead of one phase. Each round
    also measures the runtime-memory points."""
    from tqdm import tqdm

    from meshtrain.launch import launch

    profile = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
               "host_mem": _host_mem(), "worlds": {}}
    rates: dict[int, list[dict]] = {w: [] for w in worlds}
    memory: dict[int, list[list[tuple[float, float]]]] = {w: [] for w in worlds}
    strategies: dict[int, list[dict]] = {w: [] for w in worlds}
    runs = sum(1 + len(MEMORY_RUNS) + len(strategy_runs(w)) for w in worlds)
    bar = tqdm(total=rounds * runs, unit="run", desc="calibrating", disable=not progress,
               file=sys.stderr)
    for _ in range(rounds):
        for w in worlds:
            rates[w].append(_combine(launch(measure_rank, nproc=w, kwargs={"budget_s": budget_s})))
            bar.update()
            memory[w].append([runtime_memory_point(w, b, layers, m) for layers, b, m in MEMORY_RUNS])
            bar.update(len(MEMORY_RUNS))
            if w > 1:
                strategies[w].append(strategy_points(w, bar.update))
    bar.close()
    for w in worlds:
        entry = _mean_of_rounds(rates[w])
        entry["runtime_memory"] = fit_runtime_memory([[(t, o) for t, o, _ in r] for r in memory[w]])
        profile["worlds"][str(w)] = entry
        entry["trainer"] = fit_trainer(profile, w, [[t for *_, t in r] for r in memory[w]])
        if w > 1:
            entry["strategies"] = fit_strategies(profile, w, strategies[w])
    return profile


# Each strategy's own runtime costs, on the reference GPT, beside DDP's: (plan, per-rank
# batch). ZeRO's gathers and scatters are staged by a CPU backend in copies of their buffers
# (gloo: up to 3x an all-gather's output), which DDP's in-place all-reduce does not need;
# tensor parallel repeats on every rank the work it does not split.
# (Tensor parallel at each width t that divides the world, the rest of the ranks over dp:
# how much it repeats depends on t, and on how many ranks share the cores.)
def strategy_runs(world: int) -> dict[str, tuple[dict, int]]:
    """name -> (plan, per-rank batch) at `world` ranks."""
    if world == 1:
        return {}
    runs = {f"zero{z}": ({"dp": world, "zero": z}, 2) for z in (1, 2, 3)}
    # the recomputed forward gathers every unit again: staged while backward's are
    runs["zero3r"] = ({"dp": world, "zero": 3, "recompute": "full"}, 8)
    runs["disk"] = ({"dp": world, "zero": 2, "offload": "disk"}, 8)
    for t in range(2, world + 1):
        if world % t == 0:
            runs[f"tp{t}"] = ({"dp": world // t, "tp": t} if t < world else {"tp": t}, 8)
    # sequence parallel: its gathers and scatters along the sequence, staged per layer,
    # on the reference GPT and a deeper one (run_model)
    runs["tp2sp"] = runs["tp2sp_deep"] = ({**runs["tp2"][0], "sequence_parallel": True}, 8)
    if world % 2 == 0:
        runs["pp2"] = ({"dp": world // 2, "pp": 2, "microbatches": 4} if world > 2 else
                       {"pp": 2, "microbatches": 4}, 8)
    if world % 4 == 0:   # tensor parallel inside a pipeline: each stage's collectives
        # beside the other stage's compute
        runs["pp2tp2"] = ({"pp": 2, "tp": 2, "microbatches": 4, "dp": world // 4}, 8)
    return runs


def run_model(name: str) -> dict:
    """The GPT a strategy run trains: the reference, or with DEEP_POINT's blocks ("_deep")."""
    return {**REFERENCE_GPT, "n_layer": DEEP_POINT[0]} if name.endswith("_deep") else REFERENCE_GPT


def strategy_points(world: int, tick=lambda: None) -> dict:
    """One round of `strategy_runs(world)`, each in fresh ranks as `--verify` runs
    a plan: the highest rank's resident growth (and each role's: pipeline stages) and the
    median rank's step time."""
    from meshtrain.launch import launch
    from meshtrain.planner.verify import verify_rank

    points = {}
    for name, (plan, batch) in strategy_runs(world).items():
        results = launch(verify_rank, nproc=world, args=(run_model(name), plan, batch),
                         kwargs={"steps": 4, "exact": False})
        by_role = {}
        for r in results:
            by_role[r["role"]] = max(by_role.get(r["role"], 0), r["peak_growth"])
        points[name] = {"peak_rss": max(by_role.values()), "peak_rss_by_role": by_role,
                        "step": statistics.median(r["step"] for r in results)}
        tick()
    return points


def fit_strategies(profile: dict, world: int, rounds: list[dict]) -> dict:
    """What the planner misses on each `strategy_runs` plan, turned into its parameters, each
    the median over the rounds of (measured - predicted with nothing fitted), never below 0:
    - zeroK: resident bytes per byte of ZeRO-K's largest collective buffer (gloo's staging;
      ZeRO-1/2's in place of the activations' heap, ZeRO-3's beside it: memory.py); zero3r
      the same with full recomputation (per layer: memory.staged_buffer_bytes);
    - disk: seconds per byte of offloaded state (paging it in and out, and the heap that
      the step's trim returns and the next step faults back in), and "disk_memory", its
      staging (the trim returns the heap it would otherwise stage in);
    - tpT: seconds per token and block of what width T does not split, and "tpT_memory",
      the resident bytes its collectives' buffers add; "tp2sp_memory", with sequence
      parallel, (fixed bytes, bytes per byte of forward traffic) through its runs on the
      reference GPT and a deeper one (its gathers and scatters are staged per layer, some
      of it reused: measured, 17-21 MB at 2 blocks and 28-37 MB at 4);
    - pp2: seconds per micro-batch per stage chunk of the pipeline runtime's own work
      (posting and matching messages), and "pp2_memory_stages", the bytes its buffers add
      on a stage before the last and on the last (they differ: the first stage keeps the
      most micro-batches' messages, the last none of the activations' sends);
    - pp2tp2: the factor on tensor parallel's collectives inside a pipeline (with every
      other term fitted: what is left of the step, against their price on the curve), and
      "pp2tp2_memory_stages" as pp2's."""
    import copy

    from meshtrain.planner.memory import forward_traffic, staged_buffer_bytes
    from meshtrain.planner.verify import plan_inputs, predict, predict_roles

    def median(values):
        return max(0.0, statistics.median(values))

    fixed = profile["worlds"][str(world)]["runtime_memory"]["fixed"]
    runs = strategy_runs(world)
    fitted, sp_points = {}, {}
    for name, (plan, batch) in runs.items():
        model = run_model(name)
        ev = predict(profile, plan, batch, model)   # with nothing fitted yet
        spec, cand, setup = plan_inputs(plan, batch, model)
        late = [r[name]["step"] - ev.time.total for r in rounds]
        extra = [r[name]["peak_rss"] - ev.mem.total for r in rounds]
        buffer = staged_buffer_bytes(spec, cand, setup)
        # ZeRO's staging: beside the activations' heap (ZeRO-3) or in it (memory.py)
        staged = [r[name]["peak_rss"] - ev.mem.allocated - fixed for r in rounds]
        if name.startswith("zero"):
            fitted[name] = median((e if plan["zero"] == 3 else s) / buffer
                                  for e, s in zip(extra, staged))
        elif name == "disk":   # its step trims the heap: a staging of its own
            fitted[name] = median(t / ev.mem.host for t in late)
            fitted[f"{name}_memory"] = median(s / buffer for s in staged)
        elif "sp" in name:   # (fixed, per byte of forward traffic): the line through the
            # reference's and the deeper GPT's (each the median over rounds)
            points = sp_points.setdefault(name.split("_")[0], [])
            points.append((sum(forward_traffic(spec, cand, setup, 0)), statistics.median(extra)))
            if len(points) == 2:
                (t0, e0), (t1, e1) = points
                rate = max(0.0, (e1 - e0) / (t1 - t0))
                fitted[f"{name.split('_')[0]}_memory"] = [max(0.0, e0 - rate * t0), rate]
        elif name.startswith("tp"):
            fitted[name] = median(t / (batch * spec.seq * (spec.layers + 1)) for t in late)
            fitted[f"{name}_memory"] = median(extra)
        else:   # pipelines: per stage kind, the first stage's and the last's
            roles = predict_roles(profile, plan, batch, model)
            fitted[f"{name}_memory_stages"] = [
                median(r[name]["peak_rss_by_role"][stage] - roles[stage].total for r in rounds)
                for stage in ("stage 0", f"stage {plan['pp'] - 1}")]
            if name == "pp2":
                fitted[name] = median(t / plan["microbatches"] for t in late)
    if "pp2tp2" in runs:   # with every other term in place
        plan, batch = runs["pp2tp2"]
        trial = copy.deepcopy(profile)
        trial["worlds"][str(world)]["strategies"] = fitted
        ev = predict(trial, plan, batch, REFERENCE_GPT)
        left = statistics.median(r["pp2tp2"]["step"] - ev.time.total for r in rounds)
        fitted["pp2tp2"] = min(5.0, max(0.2, 1 + left / ev.time.tp_comm)) if ev.time.tp_comm else 1.0
    fitted["rounds"] = rounds
    return fitted


def runtime_memory_point(world: int, batch: int, layers: int = REFERENCE_GPT["n_layer"],
                         microbatches: int = 1) -> tuple[tuple[float, float], float, float]:
    """((first layer's, the rest's forward traffic), runtime memory, step seconds) of the
    reference GPT with `layers` blocks at `batch` (in `microbatches`) on `world` ranks, in fresh ranks (a heap
    already grown by an earlier run would hide this run's growth), run exactly as `--verify`
    runs a plan; see the module docstring."""
    from meshtrain.launch import launch
    from meshtrain.planner.memory import forward_traffic, transient_bytes
    from meshtrain.planner.verify import plan_inputs, verify_rank

    model = {**REFERENCE_GPT, "n_layer": layers}
    plan = {"dp": world, "microbatches": microbatches}
    results = launch(verify_rank, nproc=world, args=(model, plan, batch),
                     kwargs={"steps": 4, "exact": False})
    spec, cand, setup = plan_inputs(plan, batch, model)
    tensors = (max(r["model_states"] for r in results) + max(r["activations"] for r in results)
               + transient_bytes(spec, cand, setup))
    step = statistics.median(r["step"] for r in results)
    return (forward_traffic(spec, cand, setup, 0), max(r["peak_growth"] for r in results)
            - tensors, step)


def fit_trainer(profile: dict, world: int, rounds: list[list[float]]) -> dict:
    """The Trainer's step against the model of a bare forward and backward: from the DDP
    steps of the runtime-memory runs (each point the median over rounds: the reference GPT
    at the two batch sizes, then the deeper one), a factor on the micro-batch's compute and
    a fixed cost per step (the optimizer's and the Trainer's own work the model leaves
    out), nearest to the points (through them, with two); the factor kept within [0.5, 2],
    the fixed cost never below 0."""
    from meshtrain.planner.verify import predict

    single = [(layers, batch) for layers, batch, m in MEMORY_RUNS if m == 1]
    points = []
    for (layers, batch), steps in zip(single, zip(*rounds)):
        model = {**REFERENCE_GPT, "n_layer": layers}
        ev = predict(profile, {"dp": world}, batch, model)   # with nothing fitted yet
        points.append((statistics.median(steps), ev.time.total, ev.time.compute))
    late = [m - p for m, p, _ in points]
    fit = _least_squares([[c, 1.0] for *_, c in points], late)
    if fit is None or fit[1] < 0:   # no fixed cost: the factor alone
        fit = [sum(c * d for (*_, c), d in zip(points, late)) / sum(c * c for *_, c in points), 0.0]
    scale = min(2.0, max(0.5, 1 + fit[0]))
    return {"compute_scale": scale, "per_step": fit[1],
            "points": [{"measured": m, "predicted": p} for m, p, _ in points]}


def fit_runtime_memory(rounds: list[list[tuple[tuple[float, float], float]]]) -> dict:
    """(fixed, per byte of the first layer's forward traffic, per byte of the rest's), from
    the runtime-memory points of each round ((first, rest), overhead): each point's overhead
    the median over the rounds, then the three terms, none negative, nearest to the points
    (three points: exact where that leaves no term negative). With only the two reference
    points, one rate for all traffic: the line through them, which the profile keeps as
    well (tensor-parallel ranks' heap grows so: Cluster.memory_terms). Two rates, because
    the first layer's heap grows several times faster than the rest's (docs/history.md).
    A fourth point, two micro-batches a step, gives "accumulation": the bytes its heap keeps
    beyond one micro-batch's (the second micro-batch's forward runs beside the first's
    gradients, made in the heap its activations left)."""
    points = [(col[0][0], statistics.median(o for _, o in col)) for col in zip(*rounds)]
    line = _line(points[0], points[len(MEMORY_BATCHES) - 1])
    fit = dict(line)
    single = points[:len(MEMORY_BATCHES) + 1]   # one micro-batch a step
    if len(single) > len(MEMORY_BATCHES):
        terms = _nonnegative_fit([(1.0, f, r) for (f, r), _ in single], [o for _, o in single])
        if terms:
            fit = dict(zip(("fixed", "per_first_layer_byte", "per_activation_byte"), terms))
    if len(points) > len(single):   # accumulating over micro-batches: what it adds
        (f, r), o = points[len(single)]
        fit["accumulation"] = max(0.0, o - fit["fixed"] - fit["per_first_layer_byte"] * f
                                  - fit["per_activation_byte"] * r)
    return {**fit, "line": {k: line[k] for k in ("fixed", "per_activation_byte")},
            "points": [{"first": f, "rest": r, "overhead": o} for (f, r), o in points],
            "per_round": [[o for _, o in r] for r in rounds]}


def _line(p0, p1) -> dict:
    """One rate for all forward traffic: the line through two ((first, rest), overhead)
    points, the rate never below 0."""
    (a0, o0), (a1, o1) = (sum(p0[0]), p0[1]), (sum(p1[0]), p1[1])
    per_act = max(0.0, (o1 - o0) / (a1 - a0)) if a1 != a0 else 0.0
    return {"fixed": max(0.0, o0 - per_act * a0), "per_activation_byte": per_act,
            "per_first_layer_byte": per_act}


def _nonnegative_fit(rows: list[tuple], rhs: list[float]) -> list[float] | None:
    """Least squares of rows . x = rhs with no term of x negative: the best over the terms
    left free (all, then any two, then any one; a term left out is 0), the larger set
    first on a tie. None where no set gives a solution."""
    k = len(rows[0])
    best = None
    for size in range(k, 0, -1):
        for free in itertools.combinations(range(k), size):
            x = _least_squares([[row[j] for j in free] for row in rows], rhs)
            if x is None or min(x) < 0:
                continue
            full = [0.0] * k
            for j, v in zip(free, x):
                full[j] = v
            miss = sum((sum(a * b for a, b in zip(row, full)) - o) ** 2
                       for row, o in zip(rows, rhs))
            if best is None or miss < best[0] * (1 - 1e-9):
                best = (miss, full)
    return best and best[1]


def _least_squares(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x minimising |rows . x - rhs| (the normal equations, by Gaussian elimination on
    columns scaled to 1); None where the columns are dependent."""
    k = len(rows[0])
    scale = [max(abs(row[j]) for row in rows) or 1.0 for j in range(k)]
    a = [[r[j] / scale[j] for j in range(k)] for r in rows]
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] + [sum(r[i] * o for r, o in zip(a, rhs))]
         for i in range(k)]
    for c in range(k):
        pivot = max(range(c, k), key=lambda i: abs(m[i][c]))
        if abs(m[pivot][c]) < 1e-12:
            return None
        m[c], m[pivot] = m[pivot], m[c]
        for i in range(k):
            if i != c:
                f = m[i][c] / m[c][c]
                m[i] = [v - f * w for v, w in zip(m[i], m[c])]
    return [m[i][k] / m[i][i] / scale[i] for i in range(k)]


def _host_mem() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16e9


def _mb(stages: list[float]) -> str:
    return " / ".join(f"{v / 1e6:.1f}" for v in stages) + " MB (first / last stage)"


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
                         f"{rt.get('per_first_layer_byte', rt['per_activation_byte']):.2f} x "
                         f"a micro-batch's first layer + {rt['per_activation_byte']:.2f} x "
                         f"the rest of its forward" + (
                             f"; + {rt['accumulation'] / 1e6:.1f} MB accumulating over "
                             f"micro-batches" if "accumulation" in rt else ""))
        tr = e.get("trainer")
        if tr:
            lines.append(f"      Trainer step: {tr['compute_scale']:.3f} x the model's compute "
                         f"+ {tr['per_step'] * 1e3:.1f} ms")
        fitted = e.get("strategies")
        if fitted:
            lines.append("      ZeRO staging: " + ", ".join(
                f"stage {k[4:]} {v:.2f} x its largest buffer" for k, v in fitted.items()
                if k.startswith("zero")) + f"; disk offload {fitted['disk'] * 1e9:.2f} ns/byte, "
                f"staging {fitted.get('disk_memory', 0):.2f} x")
            lines.append("      tensor parallel's unsplit work: " + ", ".join(
                f"tp={k[2:]} {v * 1e9:.0f} ns per token and block + "
                f"{fitted[k + '_memory'] / 1e6:.1f} MB" for k, v in fitted.items()
                if k.startswith("tp") and k[2:].isdigit())
                + (f"; with sequence parallel + {fitted['tp2sp_memory'][0] / 1e6:.1f} MB + "
                   f"{fitted['tp2sp_memory'][1]:.2f} x the forward traffic"
                   if "tp2sp_memory" in fitted else "")
                + (f"; pipeline runtime {fitted['pp2'] * 1e3:.2f} ms per micro-batch and "
                   f"chunk + {_mb(fitted['pp2_memory_stages'])}" if "pp2" in fitted else "")
                + (f"; tensor parallel in a pipeline: its collectives x {fitted['pp2tp2']:.2f}"
                   f", + {_mb(fitted['pp2tp2_memory_stages'])}" if "pp2tp2" in fitted else ""))
        for kind, c in e["collectives"].items():
            pts = ", ".join(f"{s / 2**20:g} MiB {fmt_rate(b, 'B/s')}" for s, b in zip(c["sizes"], c["busbw"]))
            lines.append(f"      {kind}: {pts}")
    return "\n".join(lines)


def calibrate_command(args) -> int:
    from meshtrain.planner.profile import save_profile
    worlds = sorted({1, 2, max(1, args.nproc)} | ({4} if args.nproc >= 4 else set()))
    print(f"calibrating on {worlds} local rank(s), {ROUNDS} rounds of about {BUDGET_S:g} s "
          f"each, with the runtime memory and each strategy on a reference GPT (about five "
          f"minutes)...", file=sys.stderr)
    profile = calibrate(tuple(worlds))
    path = save_profile(profile, args.profile)
    print(describe(profile))
    print(f"profile saved to {path}; plan with it: meshtrain plan --cluster local ...")
    return 0
