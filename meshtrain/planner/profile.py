"""A calibrated machine profile on disk, and the Cluster the time model builds from it.

The profile holds, per calibrated world size (ranks on this machine, one thread each): the
matmul rate each rank achieves while all run (the "peak"), the rate a reference transformer
step achieves (so efficiency = achieved / peak), memory-copy bandwidth, and each collective's
bus bandwidth at several message sizes measured through meshtrain's accounted `Comm`; the
AdamW update rate; and the runtime memory (fixed + per activation byte) a rank needs beyond
its tensors. The reference step at two batch sizes separates its FLOP rate from a fixed cost
per micro-batch (`step_costs`), and on CPU ranks at two widths its matmuls' rate from its
elementwise work's (`elementwise_split`); world 1's rate against world w's is what a rank gains while
others idle (more ranks than cores). Per world > 1, `strategies`: what each strategy costs
beyond the model on the reference GPT (meshtrain.measure.fit.fit_strategies): ZeRO's staging copies,
disk offload's paging, tensor parallel's unsplit work and buffers, the pipeline runtime's
work per micro-batch and its buffers. Calibrated on CUDA ranks, `device_mem`: the GPU's
memory, each rank's (on CPU ranks a rank has its share of `host_mem`).

A profile is kept per device kind (hardware.device_kind: "H100-80GB", "cpu-2"), at
profiles/<kind>.json: `--cluster local` reads this machine's kind, `--gpu KIND` a named
GPU's (planner.calibrated), and a profile.json from before kinds still serves.

On CUDA ranks (a profile whose device type is "cuda") the host and the device are two: the
reference GPT is sized for the GPU (measure/runs.py), a micro-batch's FLOPs run at the
GEMM and attention efficiency measured at its own shapes against the device's dense peak,
and its dispatch (the launch cost times the ops a block launches) overlaps the device's
work instead of adding to it (`gpu_settings`). The Trainer's factor and fixed cost per step
are fitted on that model as on CPU ranks.

Not measured: how much gradient all-reduce hides behind backward. On CPU ranks gloo's
threads run on the cores backward uses (one thread per rank, ranks <= cores), so hiding buys
little; a local cluster takes LOCAL_OVERLAP. (The verified plans put the whole small model
in one 25 MiB bucket, which is ready only when backward ends: nothing to hide there.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from meshtrain.planner.hardware import Cluster, Curve, HardwareError
from meshtrain.planner.model_spec import from_gpt_shape
from meshtrain.planner.flops import elementwise_bytes_per_token, step_flops

# The reference GPT calibration times (meshtrain.models.gpt.GPTConfig's fields) at two
# batch sizes: its rate and its fixed cost per micro-batch (step_costs)
REFERENCE_GPT = dict(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256)
REFERENCE_BATCH, SMALL_BATCH = 8, 2
# ... and at half its width, on CPU ranks: a step's work that grows with the width (its
# elementwise passes) apart from what grows with its square (the matmuls): elementwise_split
NARROW_GPT = dict(REFERENCE_GPT, d_model=REFERENCE_GPT["d_model"] // 2)
PROFILES = Path("~/.cache/meshtrain/profiles")   # <device kind>.json (hardware.device_kind)
DEFAULT_PATH = Path("~/.cache/meshtrain/profile.json")   # the one profile kept before kinds
LOCAL_OVERLAP = 0.0


def kind_path(kind: str) -> Path:
    return (PROFILES / f"{kind}.json").expanduser()


def profile_path(path: str | os.PathLike | None = None, kind: str | None = None) -> Path:
    """Where a profile is read: `path` when given, else the profile of device `kind`. A
    profile.json from before profiles were kept per kind stands in for a kind with none of
    its own, unless it names another kind."""
    if path:
        return Path(path).expanduser()
    legacy = DEFAULT_PATH.expanduser()
    if kind is None:
        return legacy
    own = kind_path(kind)
    if not own.exists() and legacy.exists() and profile_kind(legacy) in (None, kind):
        return legacy
    return own


def profile_kind(path: Path) -> str | None:
    """The device kind a profile file was measured on; None for one from before kinds."""
    try:
        return json.loads(path.read_text()).get("device", {}).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def save_profile(profile: dict, path=None) -> Path:
    target = profile_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(target)
    return target


def load_profile(path=None, kind: str | None = None) -> dict:
    target = profile_path(path, kind)
    if not target.exists():
        on = f" on this device ({kind})" if kind and not path else ""
        raise HardwareError(f"no calibrated profile at {target}: run `meshtrain plan "
                            f"--calibrate` first{on} (or pass --profile PATH)")
    try:
        profile = json.loads(target.read_text())
        profile["worlds"]
    except (ValueError, KeyError) as exc:
        raise HardwareError(f"{target} is not a meshtrain profile ({exc}); run `meshtrain "
                            f"plan --calibrate` again") from None
    return profile


def cluster_from_profile(profile: dict, world: int | None = None, nodes: int = 1,
                         **extra) -> Cluster:
    """The Cluster of `world` local ranks (default: the largest calibrated world)."""
    worlds = {int(k): v for k, v in profile["worlds"].items()}
    w = world or max(worlds)
    if w not in worlds:
        raise HardwareError(f"the profile has no measurements at {w} ranks (it has "
                            f"{sorted(worlds)}); run `meshtrain plan --calibrate --nproc {w}`")
    entry = worlds[w]
    curves = {kind: Curve(tuple(c["sizes"]), tuple(c["busbw"]))
              for kind, c in entry.get("collectives", {}).items()}
    ar = curves.get("all_reduce")
    link = ar.busbw[-1] if ar else entry["mem_bw"]
    rate, per_block = step_costs(entry)
    split = elementwise_split(entry)
    peak = max(entry["matmul_flops"], rate, split[0] if split else 0.0)
    alone = worlds.get(1, entry)
    # what a rank gains while others wait (a pipeline's fill and drain): more ranks than
    # cores share them, and an idle rank's core goes to the busy ones
    speedup = max(1.0, step_costs(alone)[0] / rate)
    # a rank's memory: its GPU's on CUDA ranks, else its share of the host's (also for a
    # profile from before `device_mem` was recorded)
    gpu_mem = profile.get("device_mem") or profile["host_mem"] / w
    settings = dict(nodes=nodes, gpus_per_node=w, gpu_mem=gpu_mem,
                    intra_bw=link, inter_bw=link, peak_flops=peak, efficiency=rate / peak,
                    mem_bw=entry["mem_bw"], host_bw=entry["mem_bw"],
                    host_mem=profile["host_mem"], name=f"local ({w} ranks)", curves=curves,
                    optimizer_rate=entry.get("optimizer_rate", 0.0), overlap=LOCAL_OVERLAP,
                    block_overhead=per_block, idle_speedup=speedup, host_is_device=True)
    if split:   # the matmuls' rate, and the elementwise work's own speed beside it
        settings.update(efficiency=split[0] / peak, elementwise_apart=True,
                        elementwise_bw=split[1])
    runtime = entry.get("runtime_memory")
    if runtime:
        settings.update(runtime_fixed=runtime["fixed"],
                        runtime_per_act=runtime["per_activation_byte"],
                        runtime_first_layer=runtime.get("per_first_layer_byte"),
                        runtime_line=(runtime["line"]["fixed"], runtime["line"]["per_activation_byte"])
                        if "line" in runtime else None,
                        accumulation_memory=runtime.get("accumulation", 0.0))
    trainer = entry.get("trainer")
    if trainer:
        settings.update(compute_scale=trainer["compute_scale"], step_overhead=trainer["per_step"])
    single = alone.get("trainer")
    if single:
        settings.update(process_trainer=(single["compute_scale"], single["per_step"]))
    fitted = entry.get("strategies")
    if fitted:
        widths = [k for k in fitted if k[:2] == "tp" and k[2:].isdigit()]
        settings.update(tp_overhead={int(k[2:]): fitted[k] for k in widths},
                        # fitted on calibration's reference GPT (a profile from before the
                        # width was recorded: the CPU's, the only one with tp runs then)
                        tp_overhead_hidden=fitted.get("tp_hidden", REFERENCE_GPT["d_model"]),
                        tp_memory={int(k[2:]): fitted.get(f"{k}_memory", 0.0) for k in widths},
                        sp_memory={int(k[2:-len("sp_memory")]): tuple(v) for k, v in fitted.items()
                                   if k.startswith("tp") and k.endswith("sp_memory")},
                        pp_overhead=fitted.get("pp2", 0.0),
                        pp_memory=tuple(fitted.get("pp2_memory_stages", ())) or fitted.get("pp2_memory", 0.0),
                        pp_tp_memory=tuple(fitted.get("pp2tp2_memory_stages", ())) or None,
                        pp_tp_scale=fitted.get("pp2tp2", 1.0),
                        disk_overhead=fitted.get("disk", 0.0),
                        staging={**{z: fitted.get(f"zero{z}", 0.0) for z in (1, 2, 3)},
                                 **({"3+recompute": fitted["zero3r"]} if "zero3r" in fitted else {}),
                                 "disk": fitted.get("disk_memory", 0.0)})
    if profile_device(profile) == "cuda":
        settings.update(gpu_settings(entry, peak, profile["device"].get("dtype", "bf16")))
    settings.update(extra)
    return Cluster(**settings)


def profile_device(profile: dict) -> str:
    """The device type ("cpu", "cuda") a profile was measured on; "cpu" for one from before
    it was recorded."""
    return profile.get("device", {}).get("type", "cpu")


def gpu_settings(entry: dict, measured_peak: float, dtype: str) -> dict:
    """The Cluster fields of CUDA ranks (module docstring): the device's dense peak (the
    table's for a GPU it knows: probe.add_efficiencies), the efficiency curves and, for a
    precision they were not measured in, the reference step's achieved rate against that
    peak; the host's work, overlapping the device's: per step, per layer held, per block
    and micro-batch and under full recomputation as its own runs measured it
    (fit.fit_host), or, in a
    profile without them, the dispatch per block from the launch cost; the
    optimizer step's moment (its temporaries per parameter, measured); every rank its own
    GPU (no shared cores to gain when others idle), the gradient exchange hidden as on GPU
    presets (NCCL runs on its own SMs), host memory apart."""
    peak = entry.get("peak_flops", measured_peak)
    curves = {family: entry[family] for family in ("gemm", "attention")
              if entry.get(family, {}).get("efficiency")}
    return dict(peak_flops=peak, efficiency=min(1.0, entry["model_flops"] / peak),
                efficiency_curves={**curves, "dtype": dtype} if "gemm" in curves else None,
                **(host_settings(entry) or {"block_overhead": 0.0}),   # none: not timed
                optimizer_temporaries=entry.get("optimizer_temporaries", 0.0),
                async_dispatch=True, idle_speedup=1.0, overlap=1.0, host_is_device=False,
                host_bw=Cluster.host_bw)


def host_settings(entry: dict) -> dict:
    """The Cluster fields of a GPU's host work from a profile entry (gpu_settings): measured
    apart (fit.fit_host), or the launch cost times the ops a block dispatches (a profile
    from before the host's runs; {} from before launches were timed)."""
    host = entry.get("host")
    if host:
        return dict(step_overhead=host["per_step"], block_overhead=host["per_block"],
                    layer_step_overhead=host["per_layer"],
                    recompute_dispatch=host["recompute_blocks"])
    ops, launches = entry.get("ops_per_block"), entry.get("launch_rate")
    return dict(block_overhead=ops / launches) if ops and launches else {}


def step_costs(entry: dict) -> tuple[float, float]:
    """(FLOP/s, seconds per block per micro-batch) of a training step on this machine, from
    the reference GPT's step timed at two batch sizes: t(b) = overhead + flops(b) / rate.
    The overhead (Python, autograd and kernel dispatch: the same for any batch) is spread
    over the reference's blocks plus one for the embedding, head and loss. A profile from
    before the second size was measured gives (its one rate, 0)."""
    big = entry["model_flops"]
    small = entry.get("model_flops_small")
    if not small:
        return big, 0.0
    spec = from_gpt_shape(**REFERENCE_GPT)
    f_big, f_small = step_flops(spec, REFERENCE_BATCH), step_flops(spec, SMALL_BATCH)
    t_big, t_small = f_big / big, f_small / small
    if t_big <= t_small:   # noise swamped the difference: no overhead to separate
        return big, 0.0
    rate = (f_big - f_small) / (t_big - t_small)
    overhead = max(0.0, t_small - f_small / rate)
    return rate, overhead / (REFERENCE_GPT["n_layer"] + 1)


def elementwise_split(entry: dict) -> tuple[float, float] | None:
    """(FLOP/s of the matmuls, bytes/s of the elementwise work) of a step on CPU ranks: the
    reference GPT's step, its fixed cost taken off (step_costs), timed at two widths; the
    matmuls' FLOPs grow with the width's square, the elementwise work's bytes
    (flops.elementwise_bytes_per_token) with the width, so the two widths' times give each
    its rate. The one rate of step_costs prices a narrower model's step as if its
    elementwise work shrank with the square too. None for a profile without the narrow
    step (GPU ranks; before it was measured), or where noise leaves a rate not positive."""
    narrow = entry.get("model_flops_narrow")
    if not narrow or not entry.get("model_flops_small"):
        return None
    rate, per_block = step_costs(entry)
    fixed = per_block * (REFERENCE_GPT["n_layer"] + 1)
    points = []   # (FLOPs, elementwise bytes, seconds less the fixed cost) per width
    for shape, measured in ((REFERENCE_GPT, entry["model_flops"]), (NARROW_GPT, narrow)):
        spec = from_gpt_shape(**shape)
        flops = step_flops(spec, REFERENCE_BATCH)
        moved = REFERENCE_BATCH * spec.seq * elementwise_bytes_per_token(spec, spec.layers)
        points.append((flops, moved, flops / measured - fixed))
    (f1, e1, t1), (f2, e2, t2) = points
    det = f1 * e2 - f2 * e1
    per_flop, per_byte = (t1 * e2 - t2 * e1) / det, (f1 * t2 - f2 * t1) / det
    if per_flop <= 0 or per_byte <= 0:
        return None
    return 1 / per_flop, 1 / per_byte


def load_profile_cluster(path=None, world: int | None = None, nodes: int = 1,
                         kind: str | None = None, **extra) -> Cluster:
    return cluster_from_profile(load_profile(path, kind), world, nodes, **extra)
