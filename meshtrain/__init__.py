"""meshtrain: train PyTorch models across many devices with every classic parallelism
strategy, composable on one device mesh, and plan which strategy fits.

The names below are imported on first use, so that `meshtrain` on the command line can start
its rank processes (which import torch) before the command itself has imported torch.
`launch` and `Plan` import no torch and are bound at once (`meshtrain.launch` is also the name
of a submodule: importing it must not leave the module where the function belongs).
"""
from __future__ import annotations

import importlib
import logging

from meshtrain.core.plan import Plan, PlanError
from meshtrain.launch import LaunchError, launch

_EXPORTS = {"Comm": "meshtrain.core.comm", "CommStats": "meshtrain.core.comm",
            "Mesh": "meshtrain.core.mesh", "Trainer": "meshtrain.train.trainer"}

# torchao (the fp8 extra) is imported by transformers' modeling stack wherever it is
# installed, and says at import that its compiled kernels do not match this torch (float8
# training does not use them) and that torch now handles its enums itself: nothing a run
# acts on, printed by every rank of every transformers run. Its errors still show.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
del _noisy

__all__ = sorted([*_EXPORTS, "LaunchError", "Plan", "PlanError", "launch"])
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
