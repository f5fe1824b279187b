"""A calibrated machine profile on disk, and the Cluster the time model builds from it.

The profile holds, per calibrated world size (ranks on this machine, one thread each): the
matmul rate each rank achieves while all run (the "peak"), the rate a reference transformer
step achieves (so efficiency = achieved / peak), memory-copy bandwidth, and each collective's
bus bandwidth at several message sizes measured through meshtrain's accounted `Comm`; the
AdamW update rate; and the runtime memory (fixed + per activation byte) a rank needs beyond
its tensors.

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

DEFAULT_PATH = Path("~/.cache/meshtrain/profile.json")
LOCAL_OVERLAP = 0.0


def profile_path(path: str | os.PathLike | None = None) -> Path:
    return Path(path or DEFAULT_PATH).expanduser()


def save_profile(profile: dict, path=None) -> Path:
    target = profile_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(target)
    return target


def load_profile(path=None) -> dict:
    target = profile_path(path)
    if not target.exists():
        raise HardwareError(f"no calibrated profile at {target}: run `meshtrain plan "
                            f"--calibrate` first (or pass --profile PATH)")
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
    settings = dict(nodes=nodes, gpus_per_node=w, gpu_mem=profile["host_mem"] / w,
                    intra_bw=link, inter_bw=link, peak_flops=entry["matmul_flops"],
                    efficiency=min(1.0, entry["model_flops"] / entry["matmul_flops"]),
                    mem_bw=entry["mem_bw"], host_bw=entry["mem_bw"],
                    host_mem=profile["host_mem"], name=f"local ({w} ranks)", curves=curves,
                    optimizer_rate=entry.get("optimizer_rate", 0.0), overlap=LOCAL_OVERLAP)
    runtime = entry.get("runtime_memory")
    if runtime:
        settings.update(runtime_fixed=runtime["fixed"],
                        runtime_per_act=runtime["per_activation_byte"])
    settings.update(extra)
    return Cluster(**settings)


def load_profile_cluster(path=None, world: int | None = None, nodes: int = 1, **extra) -> Cluster:
    return cluster_from_profile(load_profile(path), world, nodes, **extra)
