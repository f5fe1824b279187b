"""Strategy planner: pure memory and time models per plan, and the advisor that ranks plans.

Pure: imports only `meshtrain.core` and itself, no strategy and no torch, and creates no
process group. Calibration and verification, which run ranks, are `meshtrain.measure`.
"""
from meshtrain.planner.advisor import Advice, NoPlanFits, advise, require_fit
from meshtrain.planner.hardware import Cluster, make_cluster
from meshtrain.planner.model_spec import ModelSpec, from_description, from_gpt_config, from_module, preset
from meshtrain.planner.setup import Candidate, Setup

__all__ = ["Advice", "Candidate", "Cluster", "ModelSpec", "NoPlanFits", "Setup", "advise",
           "from_description", "from_gpt_config", "from_module", "make_cluster", "preset",
           "require_fit"]
