"""Calibration's fits: the measured points turned into the profile's parameters (the
runtime memory, the Trainer's step, each strategy's own costs), least squares with no
negative term."""
from __future__ import annotations

import copy
import itertools
import statistics

from meshtrain.measure.runs import (HOST_RUNS, MEMORY_BATCHES, MEMORY_RUNS, reference_gpt,
                                    run_model, run_plan, strategy_runs)
from meshtrain.measure.verify import plan_inputs, predict, predict_cluster, predict_roles
from meshtrain.planner.activations import forward_traffic
from meshtrain.planner.profile import profile_device
from meshtrain.planner.states import staged_buffer_bytes
from meshtrain.planner.compute_time import dispatch_time


def fit_strategies(profile: dict, world: int, rounds: list[dict]) -> dict:
    """What the planner misses on each `strategy_runs` plan, turned into its parameters, each
    the median over the rounds of (measured - predicted with nothing fitted), never below 0:
    - zeroK: resident bytes per byte of ZeRO-K's largest collective buffer (gloo's staging;
      ZeRO-1/2's in place of the activations' heap, ZeRO-3's beside it: memory.py); zero3r
      the same with full recomputation (per layer: states.staged_buffer_bytes);
    - disk: seconds per byte of offloaded state (paging it in and out, and the heap that
      the step's trim returns and the next step faults back in), and "disk_memory", its
      staging (the trim returns the heap it would otherwise stage in);
    - tpT: seconds per token and block of what width T does not split ("tp_hidden": the
      model's width, which the planner scales it from), and "tpT_memory",
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
    def median(values):
        return max(0.0, statistics.median(values))

    fixed = profile["worlds"][str(world)]["runtime_memory"]["fixed"]
    device = profile_device(profile)
    runs = {name: (run_plan(plan, device), batch)
            for name, (plan, batch) in strategy_runs(world).items()}
    fitted, sp_points = {}, {}
    for name, (plan, batch) in runs.items():
        model = run_model(name, device)
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
            fitted["tp_hidden"] = spec.hidden   # the width it scales from
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
        ev = predict(trial, plan, batch, reference_gpt(device))
        left = statistics.median(r["pp2tp2"]["step"] - ev.time.total for r in rounds)
        fitted["pp2tp2"] = min(5.0, max(0.2, 1 + left / ev.time.tp_comm)) if ev.time.tp_comm else 1.0
    fitted["rounds"] = rounds
    return fitted


def fit_host(rounds: list[list[float]]) -> dict:
    """The host's side of a GPU step from the HOST_RUNS steps of each round (each point the
    median over rounds), as the time model adds it up: seconds per step, per layer a rank
    holds (once a step: the optimizer's and the Trainer's work over its tensors), per block and
    micro-batch (the embedding, head and loss one more block), and the blocks' dispatch a
    block costs under full recomputation (its second forward and the checkpoint's own
    work). HOST_RUNS' four points (short, deep, deep in several micro-batches, deep
    recomputed) give the four exactly; none below 0, recomputation not below one block."""
    steps = [statistics.median(point) for point in zip(*rounds)]
    short, deep, many, recomputed = steps
    (l_short, _, _), (l_deep, _, _), (_, m_many, _), _ = HOST_RUNS
    per_block = max(0.0, (many - deep) / ((m_many - 1) * (l_deep + 1)))
    per_layer = max(0.0, (deep - short) / (l_deep - l_short) - per_block)
    per_step = max(0.0, short - per_layer * l_short - per_block * (l_short + 1))
    recompute = max(1.0, 1 + (recomputed - deep) / (per_block * l_deep)) if per_block else 1.0
    return {"per_step": per_step, "per_layer": per_layer, "per_block": per_block,
            "recompute_blocks": recompute,
            "points": [{"layers": l, "microbatches": m, "recompute": r, "step": t}
                       for (l, m, r), t in zip(HOST_RUNS, steps)]}


def fit_trainer(profile: dict, world: int, rounds: list[list[float]]) -> dict:
    """The Trainer's step against the model of a bare forward and backward: from the DDP
    steps of the runtime-memory runs (each point the median over rounds: the reference GPT
    at the two batch sizes, then the deeper one), a factor on the micro-batch's compute and
    a fixed cost per step (the optimizer's and the Trainer's own work the model leaves
    out), nearest to the points (through them, with two); the factor kept within [0.5, 2],
    the fixed cost never below 0. On GPU ranks, the host's cost and the device's apart
    (`_fit_queued_trainer`)."""
    single = [(layers, batch) for layers, batch, m in MEMORY_RUNS if m == 1]
    device = profile_device(profile)
    points = []
    for (layers, batch), steps in zip(single, zip(*rounds)):
        model = reference_gpt(device, layers)   # as runtime_memory_point ran it
        # with nothing fitted yet
        ev = predict(profile, run_plan({"dp": world}, device), batch, model)
        points.append((statistics.median(steps), ev.time.total, ev.time.compute))
    if device == "cuda":
        return _fit_queued_trainer(profile, world, points, single)
    late = [m - p for m, p, _ in points]
    fit = _least_squares([[c, 1.0] for *_, c in points], late)
    if fit is None or fit[1] < 0:   # no fixed cost: the factor alone
        fit = [sum(c * d for (*_, c), d in zip(points, late)) / sum(c * c for *_, c in points), 0.0]
    scale = min(2.0, max(0.5, 1 + fit[0]))
    return {"compute_scale": scale, "per_step": fit[1],
            "points": [{"measured": m, "predicted": p} for m, p, _ in points]}


def _fit_queued_trainer(profile: dict, world: int, points: list, single: list) -> dict:
    """fit_trainer on GPU ranks, whose host queues a step ahead of the device (the time
    model's `async_dispatch`: the step is the slower of the device's work and the host's).
    The larger points keep the device busy: the factor on compute is the one nearest to
    them (through the origin). The host's fixed cost per step is the one its own runs
    measured (fit_host); a profile without them takes it from the smallest point: what that
    step took beyond its micro-batch's dispatch, so the fitted model meets it whichever side
    bound it. (One line through all three would turn the host's work at the smallest batch
    into a fixed cost that every larger step pays.)"""
    (m_small, *_), *device_bound = points
    late = [(m - p, c) for m, p, c in device_bound]
    factor = sum(c * d for d, c in late) / sum(c * c for _, c in late)
    host = profile["worlds"][str(world)].get("host")
    if host:
        per_step = host["per_step"]
    else:
        layers, batch = single[0]
        plan = run_plan({"dp": world}, "cuda")
        spec, cand, _ = plan_inputs(plan, batch, reference_gpt("cuda", layers))
        per_step = max(0.0, m_small - dispatch_time(spec, cand, predict_cluster(profile, plan)))
    return {"compute_scale": min(2.0, max(0.5, 1 + factor)), "per_step": per_step,
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
