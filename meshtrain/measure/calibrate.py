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
On the device itself, in the run's dtype (bf16 on CUDA, fp32 on CPU: runs.py), it also
measures GPT-shaped GEMMs and causal attention (forward and backward) at a few sizes, each
as an efficiency against the device's dense peak (the table's for a GPU it knows, else the
square matmul), the time one op takes to launch, and how many ops a block dispatches: what
`plan --gpu KIND` takes from a profile of that kind (planner/calibrated.py). The profile
names its device kind (hardware.device_kind) and is saved as profiles/<kind>.json.

The host's side of a GPU step (Python, autograd, kernel launches, the Trainer's and the
optimizer's own work), which the device's work hides until it outlasts it: a launch's cost
times the ops a block dispatches counts the launches only, a third of what the host spends
per block in a Trainer's step. So in each round the Trainer trains a GPT too narrow to keep
the GPU busy (runs.HOST_RUNS: 2 and 8 blocks, 4 micro-batches, full recomputation), and its
steps give the host's cost per step, per layer, per block and micro-batch, and of a
recomputed block (fit.fit_host).

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
bytes, bytes per activation byte). On CUDA ranks the memory is the GPU's: the growth is of
what the caching allocator reserves there (measure.peaks), and the profile records the
GPU's memory (`device_mem`), which `--cluster local` gives each rank.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

from meshtrain.core.device import gpu_count, resolve_device, total_memory
from meshtrain.launch import launch
from meshtrain.measure.fit import fit_host, fit_runtime_memory, fit_strategies, fit_trainer
from meshtrain.measure.probe import add_efficiencies, combine, mean_of_rounds, measure_rank
from meshtrain.measure.runs import (BUDGET_S, GPU_ROUNDS, HOST_GPT, HOST_RUNS, MEMORY_RUNS,
                                    ROUNDS, SQUARE, reference_gpt, run_model, run_plan,
                                    strategy_runs)
from meshtrain.measure.verify import plan_inputs, verify_rank
from meshtrain.planner.activations import forward_traffic, transient_bytes
from meshtrain.planner.hardware import GPUS
from meshtrain.planner.memory import optimizer_step_bytes
from meshtrain.planner.profile import elementwise_split, kind_path, profile_device, save_profile
from meshtrain.core.units import fmt_rate


def calibrate(worlds=(1, 2, 4), rounds: int = ROUNDS, budget_s: float = BUDGET_S,
              progress: bool = True) -> dict:
    """Measure every world size in `rounds` rounds (1, 2, 4, 1, 2, 4, ...): this machine's
    speed may drift between phases lasting seconds (docs/history.md), and rounds
    spread each world's samples over the whole calibration instead of one phase. Each round
    also measures the runtime-memory points."""
    profile = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
               "host_mem": _host_mem(), "worlds": {}}
    rates: dict[int, list[dict]] = {w: [] for w in worlds}
    memory: dict[int, list[list[tuple[float, float]]]] = {w: [] for w in worlds}
    strategies: dict[int, list[dict]] = {w: [] for w in worlds}
    host: dict[int, list[list[float]]] = {w: [] for w in worlds}
    device = resolve_device()
    host_runs = HOST_RUNS if device == "cuda" else ()   # CPU ranks: the host is the device
    runs = sum(1 + len(MEMORY_RUNS) + len(host_runs) + len(strategy_runs(w)) for w in worlds)
    bar = tqdm(total=rounds * runs, unit="run", desc="calibrating", disable=not progress,
               file=sys.stderr)
    for _ in range(rounds):
        for w in worlds:
            rates[w].append(combine(launch(measure_rank, nproc=w, kwargs={"budget_s": budget_s})))
            bar.update()
            # on CUDA, this round's optimizer temporaries (CPU ranks measure none)
            step = [rates[w][-1]["optimizer_temporaries"]] if device == "cuda" else []
            memory[w].append([runtime_memory_point(w, b, layers, m, *step)
                              for layers, b, m in MEMORY_RUNS])
            bar.update(len(MEMORY_RUNS))
            if host_runs:
                host[w].append([host_step(w, *run) for run in host_runs])
                bar.update(len(host_runs))
            if w > 1:
                strategies[w].append(strategy_points(w, bar.update))
    bar.close()
    profile.update(device_figures(device, rates[worlds[0]][0]["device_kind"]))
    kind = profile["device"]["kind"]
    for w in worlds:
        entry = mean_of_rounds(rates[w])
        add_efficiencies(entry, kind, profile["device"]["dtype"])
        entry["runtime_memory"] = fit_runtime_memory([[(t, o) for t, o, _ in r] for r in memory[w]])
        if host[w]:   # before the Trainer's fit, which prices the host by it
            entry["host"] = fit_host(host[w])
        profile["worlds"][str(w)] = entry
        entry["trainer"] = fit_trainer(profile, w, [[t for *_, t in r] for r in memory[w]])
        if w > 1:
            entry["strategies"] = fit_strategies(profile, w, strategies[w])
    return profile


def device_figures(device: str, kind: str) -> dict:
    """The profile's device fields: the device (its kind, type, the run's dtype, how many)
    and on CUDA `device_mem`, the GPU's memory: a CUDA rank's memory is its GPU's, not a
    share of the host's (`cluster_from_profile`)."""
    figures = {"device": {"kind": kind, "type": device, "dtype": SQUARE[device][1],
                          "count": gpu_count() if device == "cuda" else os.cpu_count()}}
    if device == "cuda":   # rank 0's GPU gave the kind; a profile is of one kind of GPU
        figures["device_mem"] = total_memory(torch.device("cuda", 0))
    return figures


def strategy_points(world: int, tick=lambda: None) -> dict:
    """One round of `strategy_runs(world)`, each in fresh ranks as `--verify` runs
    a plan: the highest rank's resident growth (and each role's: pipeline stages) and the
    median rank's step time."""
    points = {}
    device = resolve_device()
    for name, (plan, batch) in strategy_runs(world).items():
        results = launch(verify_rank, nproc=world,
                         args=(run_model(name, device), run_plan(plan, device), batch),
                         kwargs={"steps": 4, "exact": False})
        by_role = {}
        for r in results:
            by_role[r["role"]] = max(by_role.get(r["role"], 0), r["peak_growth"])
        points[name] = {"peak_rss": max(by_role.values()), "peak_rss_by_role": by_role,
                        "step": statistics.median(r["step"] for r in results)}
        tick()
    return points

def runtime_memory_point(world: int, batch: int, layers: int | None = None,
                         microbatches: int = 1, optimizer_step: float | None = None
                         ) -> tuple[tuple[float, float], float, float]:
    """((first layer's, the rest's forward traffic), runtime memory, step seconds) of the
    reference GPT with `layers` blocks (None: its own) at `batch` (in `microbatches`) on
    `world` ranks, in fresh ranks (a heap already grown by an earlier run would hide this
    run's growth), run exactly as `--verify` runs a plan; see the module docstring. With
    `optimizer_step` (CUDA: the step's temporaries per parameter), the tensors at the peak
    are those of the larger of backward's moment and the optimizer step's."""
    device = resolve_device()
    model = reference_gpt(device, layers)
    plan = run_plan({"dp": world, "microbatches": microbatches}, device)
    results = launch(verify_rank, nproc=world, args=(model, plan, batch),
                     kwargs={"steps": 4, "exact": False})
    spec, cand, setup = plan_inputs(plan, batch, model)
    states = max(r["model_states"] for r in results)
    tensors = states + max(r["activations"] for r in results) + transient_bytes(spec, cand, setup)
    if optimizer_step is not None:
        optim = max(r["optimizer_states"] for r in results)
        tensors = max(tensors, states + optimizer_step_bytes(optim, setup, optimizer_step))
    step = statistics.median(r["step"] for r in results)
    return (forward_traffic(spec, cand, setup, 0), max(r["peak_growth"] for r in results)
            - tensors, step)


def host_step(world: int, layers: int, microbatches: int, recompute: str) -> float:
    """Seconds of the Trainer's step on HOST_GPT with `layers` blocks, `microbatches` of one
    sequence and `recompute`, in fresh ranks as `--verify` runs a plan (the median rank's):
    the host's time, which the device's work on so narrow a GPT never outlasts."""
    plan = run_plan({"dp": world, "microbatches": microbatches, "recompute": recompute},
                    resolve_device())
    results = launch(verify_rank, nproc=world, args=({**HOST_GPT, "n_layer": layers}, plan,
                                                     microbatches),
                     kwargs={"steps": 8, "exact": False})
    return statistics.median(r["step"] for r in results)


def _host_mem() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16e9


def _mb(stages: list[float]) -> str:
    return " / ".join(f"{v / 1e6:.1f}" for v in stages) + " MB (first / last stage)"


def describe(profile: dict) -> str:
    lines = [f"calibrated {profile['created']} on {profile.get('device', {}).get('kind', 'cpu')} "
             f"({profile['cpu_count']} cores, {profile['host_mem'] / 1e9:.3g} GB host memory"
             + (f", {profile['device_mem'] / 1e9:.3g} GB per GPU" if "device_mem" in profile
                else "") + ")"]
    for w, e in profile["worlds"].items():
        lines.append(f"  {w} rank(s): matmul {fmt_rate(e['matmul_flops'], 'FLOP/s')} per rank, "
                     f"GPT step {fmt_rate(e['model_flops'], 'FLOP/s')} "
                     f"({e['model_flops'] / e['matmul_flops']:.0%}), copy {fmt_rate(e['mem_bw'], 'B/s')}, "
                     f"AdamW {fmt_rate(e.get('optimizer_rate', 0), 'param/s')}")
        lines += _device_lines(e)
        rt = e.get("runtime_memory")
        if rt:
            lines.append(f"      runtime memory: {rt['fixed'] / 1e6:.1f} MB + "
                         f"{rt.get('per_first_layer_byte', rt['per_activation_byte']):.2f} x "
                         f"a micro-batch's first layer + {rt['per_activation_byte']:.2f} x "
                         f"the rest of its forward" + (
                             f"; + {rt['accumulation'] / 1e6:.1f} MB accumulating over "
                             f"micro-batches" if "accumulation" in rt else ""))
        tr, host = e.get("trainer"), e.get("host")
        if tr and host:   # fit.fit_host
            lines.append(f"      Trainer step: the slower of {tr['compute_scale']:.3f} x the "
                         f"model's compute and the host's {host['per_step'] * 1e3:.1f} ms + "
                         f"{host['per_layer'] * 1e3:.2f} ms per layer + "
                         f"{host['per_block'] * 1e3:.2f} ms per block and micro-batch (a "
                         f"recomputed block {host['recompute_blocks']:.2f} blocks)")
        elif tr and profile_device(profile) == "cuda":   # fit._fit_queued_trainer
            lines.append(f"      Trainer step: the slower of {tr['compute_scale']:.3f} x the "
                         f"model's compute and the host's {tr['per_step'] * 1e3:.1f} ms + "
                         f"its dispatch")
        elif tr:
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


def _device_lines(entry: dict) -> list[str]:
    """The GEMM and attention efficiencies by shape and the launch cost (probe.device_work)."""
    lines = []
    for family in ("gemm", "attention"):
        curve = entry.get(family)
        if curve and "efficiency" in curve:
            lines.append(f"      {family} efficiency: " + ", ".join(
                f"{'x'.join(map(str, s))} {e:.0%}" for s, e in zip(curve["shapes"], curve["efficiency"]))
                + f" of {fmt_rate(entry['peak_flops'], 'FLOP/s')}")
    if entry.get("launch_rate"):
        lines.append(f"      launch: {1e6 / entry['launch_rate']:.2f} us per op, "
                     f"{entry['ops_per_block']:.0f} ops per block and micro-batch")
    split = elementwise_split(entry)
    if split:
        lines.append(f"      at two widths: matmuls {fmt_rate(split[0], 'FLOP/s')}, elementwise "
                     f"work {fmt_rate(split[1], 'B/s')} (its bytes as flops.py counts them)")
    return lines


def calibrate_worlds(nproc: int, device: str) -> list[int]:
    """World sizes to calibrate: 1, 2 and `nproc` (4 too below a larger one); on CUDA at
    most one rank per visible GPU."""
    worlds = {1, 2, max(1, nproc)} | ({4} if nproc >= 4 else set())
    most = gpu_count() if device == "cuda" else max(worlds)
    return sorted(w for w in worlds if w <= most)


def save_calibration(profile: dict, path=None):
    """Save `profile` at `path`, by default as its device kind's (profiles/<kind>.json)."""
    return save_profile(profile, path or kind_path(profile["device"]["kind"]))


def calibrate_command(args, rounds: int | None = None, budget_s: float = BUDGET_S) -> int:
    device = resolve_device()
    worlds = calibrate_worlds(args.nproc, device)
    rounds = rounds or (GPU_ROUNDS if device == "cuda" else ROUNDS)
    print(f"calibrating on {worlds} local rank(s), {rounds} rounds of about {budget_s:g} s "
          f"each, with the runtime memory and each strategy on the reference GPT "
          f"{reference_gpt(device)} ({SQUARE[device][1]}; a few minutes)...", file=sys.stderr)
    profile = calibrate(tuple(worlds), rounds, budget_s)
    path = save_calibration(profile, args.profile)
    print(describe(profile))
    kind = profile["device"]["kind"]
    print(f"profile of {kind} saved to {path}; plan with it: meshtrain plan --cluster local "
          f"..." + (f" (or --gpu {kind} on a cluster of them)" if kind in GPUS else ""))
    return 0
