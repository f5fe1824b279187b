"""Strategy planner: pure memory and time models per plan, and the advisor that ranks plans.

Imports no strategy and creates no process group; calibration and verification (which do
run ranks) live in `calibrate.py` and `verify.py` and are imported only when asked for.
"""
from meshtrain.planner.advisor import Advice, NoPlanFits, advise, require_fit
from meshtrain.planner.hardware import Cluster, make_cluster
from meshtrain.planner.model_spec import ModelSpec, from_description, from_gpt_config, from_module, preset
from meshtrain.planner.setup import Candidate, Setup

__all__ = ["Advice", "Candidate", "Cluster", "ModelSpec", "NoPlanFits", "Setup", "advise",
           "from_description", "from_gpt_config", "from_module", "make_cluster", "preset",
           "require_fit"]
