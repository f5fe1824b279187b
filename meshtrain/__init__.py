"""meshtrain: train PyTorch models across many devices with every classic parallelism
strategy, composable on one device mesh, and plan which strategy fits."""
from meshtrain.core.plan import Plan, PlanError

__all__ = ["Plan", "PlanError"]
__version__ = "0.1.0"
