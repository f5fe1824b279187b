"""meshtrain: train PyTorch models across many devices with every classic parallelism
strategy, composable on one device mesh, and plan which strategy fits.

The names below are imported on first use, so that `meshtrain` on the command line can start
its rank processes (which import torch) before the command itself has imported torch.
`launch` and `Plan` import no torch and are bound at once (`meshtrain.launch` is also the name
of a submodule: importing it must not leave the module where the function belongs).
"""
from __future__ import annotations

import importlib

from meshtrain.core.plan import Plan, PlanError
from meshtrain.launch import LaunchError, launch

_EXPORTS = {"Comm": "meshtrain.core.comm", "CommStats": "meshtrain.core.comm",
            "Mesh": "meshtrain.core.mesh", "Trainer": "meshtrain.train.trainer"}

__all__ = sorted([*_EXPORTS, "LaunchError", "Plan", "PlanError", "launch"])
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
