"""A resumed rank reads only what it keeps of a checkpoint (`Trainer.load`).

Each slot answers, per parameter name, which part of the whole tensor this rank keeps:
slot 2 which names (its stages' parameters and buffers), slot 1 which boxes of each
(`LayerSharding.region`: a tp slice, each fused part, an ep rank's experts), slot 3 which
flat range of that (`GradientSync.flat_regions`: ZeRO's shard; of the parameter under
ZeRO-3 only, of its optimizer states under ZeRO-1/2/3). The checkpoint reads those
regions alone ([Note: a checkpoint in chunks] in checkpoint_regions.py) and each slot takes
its part as it is: no rank holds a whole tensor it does not keep.
"""
from __future__ import annotations

import torch

from meshtrain.core.plan import LOCAL_STEP_MODES
from meshtrain.core.regions import Region, whole
from meshtrain.strategies.data_parallel.diloco import one_replica_state
from meshtrain.train import checkpoint
from meshtrain.train.checkpoint_regions import EntryPath, RegionOf


def kept_regions(trainer) -> RegionOf:
    """What of each saved tensor `trainer`'s rank keeps (None: nothing)."""
    held = {name for name, _ in trainer.stages.named_parameters()}
    buffers = {name for name, _ in trainer.stages.named_buffers()}
    canonical, sharding = trainer.layout.canonical, trainer.sharding
    flat_regions = trainer.data_parallel.flat_regions

    def region_of(entry: EntryPath, shape: tuple[int, ...]) -> Region | None:
        if entry[0] == "model" and len(entry) == 2:
            name = canonical.get(entry[1])
            if name != entry[1]:
                return None   # a tied tensor's other key: read under its first
            if name in held:
                return sharding.region(name, shape).within(flat_regions(name)[0])
            return whole(shape) if name in buffers else None
        if entry[:2] == ("optim", "state") and len(entry) == 4 and entry[2] in held:
            if not shape:
                return whole(shape)   # a step counter
            return sharding.region(entry[2], shape).within(flat_regions(entry[2])[1])
        return None
    return region_of


def cuts_of(trainer):
    """Where `trainer`'s plan cuts each tensor it saves, by entry path."""
    canonical, sharding = trainer.layout.canonical, trainer.sharding
    params = set(trainer.layout.parameters)

    def cuts(entry: EntryPath, shape: tuple[int, ...]) -> list[list[int]]:
        name = (canonical.get(entry[1]) if entry[0] == "model" and len(entry) == 2 else
                entry[2] if entry[:2] == ("optim", "state") and len(entry) == 4 else None)
        return sharding.cuts(name, shape) if name in params and shape else []
    return cuts


def load(trainer, path) -> dict:
    """Restore `trainer`'s model and optimizer from `path` (saved under any plan), reading
    its regions alone; returns the checkpoint's extras."""
    model, optim, extra, read = checkpoint.load_regions(path, trainer.layout,
                                                        kept_regions(trainer))
    saved_mode = checkpoint.read_meta(path).get("plan", {}).get("dp_mode")
    params = {name: model[name] for name, _ in trainer.stages.named_parameters()}
    take_local_state(trainer, params, model, optim, saved_mode)
    trainer.checkpoint_read = read
    return extra


def take_local_state(trainer, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                     optimizer_state: dict | None, saved_mode: str | None) -> None:
    """Give `trainer`'s slots this rank's parameters and their optimizer states, each as
    slot 1 slices it (or narrowed to `flat_regions`), and its stage's buffers from `buffers`
    (by name), under the saving dp_mode `saved_mode`; no communication."""
    if optimizer_state is not None and trainer.plan.dp_mode not in LOCAL_STEP_MODES:
        # every diloco / local-sgd worker's state: one replica's, or refused (mid-round)
        optimizer_state = one_replica_state(optimizer_state, trainer.plan.dp_mode, saved_mode)
    with torch.no_grad():
        for name, buffer in trainer.stages.named_buffers():
            buffer.copy_(buffers[name])
    local_optim = None if optimizer_state is None else (
        {n: s for n, s in optimizer_state["state"].items() if n in params},
        optimizer_state["param_groups"])
    trainer.data_parallel.load_local(params, local_optim)
