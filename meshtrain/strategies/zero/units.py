"""ZeRO-3's wrapping units: which modules are gathered one at a time, whether a step calls
each of them, and the tensors a unit's output carries (its backward hook's trigger)."""
from __future__ import annotations

import collections

import torch
from torch import nn

from meshtrain.core.plan import PlanError
from meshtrain.models.structure import units_of


def wrapping_units(model: nn.Module, names: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules ZeRO-3 gathers one at a time, in forward order: `names` if given (module
    names as `named_modules()` gives them), else the model's units (a transformers causal LM's
    decoder layers, `layers()`, or its children: models/structure.py)."""
    by_module = {id(m): n for n, m in model.named_modules()}
    if names is not None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules or n == ""]
        if missing:
            raise PlanError(f"ZeRO-3 wrapping units {missing} name no module of "
                            f"{type(model).__name__}; name modules as named_modules() gives "
                            f"them, e.g. {[n for n, _ in model.named_children()][:4]}")
        return [(n, modules[n]) for n in names]
    layers = units_of(model)
    return [(by_module.get(id(m), str(i)), m) for i, m in enumerate(layers)]


def check_units_run(units, entries: list[nn.Module], named_params) -> None:
    """Each unit holding parameters of its own here must be called inside what a step calls
    (a unit spanning pipeline stages never is: its hooks would never gather it). Parameters
    of several units (tied) are the root's, gathered by the entries' own hooks."""
    inside = {id(m) for entry in entries for m in entry.modules()}
    units_of_param = collections.Counter(id(p) for _, m in units for p in m.parameters())
    own = {id(p) for _, p in named_params if units_of_param[id(p)] == 1}
    stray = [n for n, m in units
             if id(m) not in inside and any(id(p) in own for p in m.parameters())]
    if stray:
        raise PlanError(f"ZeRO-3 wrapping units {stray} are not called inside one pipeline "
                        "stage (a unit spanning stages, or a container never called); name "
                        "modules inside the stages' layers in zero3_units, or leave it unset")


def output_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in output_tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in output_tensors(o)]
    return []
