"""meshtrain: train PyTorch models across many devices with every classic parallelism
strategy, composable on one device mesh, and plan which strategy fits."""
from meshtrain.core.comm import Comm, CommStats
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import Plan, PlanError
from meshtrain.launch import LaunchError, launch
from meshtrain.train.trainer import Trainer

__all__ = ["Comm", "CommStats", "LaunchError", "Mesh", "Plan", "PlanError", "Trainer", "launch"]
__version__ = "0.1.0"
