"""Expert parallel (slot 1 on the ep axis, carved from dp): each MoE layer's experts split
over ep ranks, tokens sent to their experts' ranks and back by all-to-all.

    groups.py     the ep and expert-data-parallel (edp) groups inside each dp group
    dispatch.py   ShardedExperts: the all-to-all dispatch and combine, differentiable
    sharding.py   ExpertParallel: the LayerSharding slot (full / local / replicas / routed)

The model's own router chooses (top-k, its normalisation, shared experts outside the experts
module all stay the model's); only the experts module is replaced. Dense weights stay
data-parallel over dp; each expert is data-parallel over its edp group (dp / ep ranks),
which the gradient sync reads from `ExpertParallel.replicas`.
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import Plan, PlanError
from meshtrain.models.experts import PACKED, experts_modules
from meshtrain.models.moe import router_of
from meshtrain.strategies.expert_parallel.dispatch import ShardedExperts
from meshtrain.strategies.expert_parallel.groups import expert_comm
from meshtrain.strategies.expert_parallel.sharding import ExpertParallel

__all__ = ["check", "shard", "experts_modules", "ExpertParallel"]


def check(model: nn.Module, plan: Plan) -> None:
    """Refuse, before any process group exists, a model expert parallel cannot split."""
    if plan.ep == 1:
        return
    router, found = router_of(model), experts_modules(model)
    if router is None or not found:
        raise PlanError(f"Plan(ep={plan.ep}) splits the experts of mixture-of-experts layers, "
                        f"and this {type(model).__name__} has none; use ep=1, or a MoE model "
                        "(e.g. --model gpt-moe-tiny or mixtral-tiny, or a GPT's --experts)")
    if router.experts % plan.ep:
        raise PlanError(f"Plan(ep={plan.ep}): {type(model).__name__}'s {router.experts} "
                        f"experts do not split over {plan.ep} ranks; use an ep that divides "
                        f"{router.experts}")
    for name, m in found.items():
        if set(dict(m.named_parameters(recurse=False))) != set(PACKED):
            extra = sorted(set(dict(m.named_parameters(recurse=False))) - set(PACKED))
            raise PlanError(f"Plan(ep={plan.ep}): the experts module {name} has parameters "
                            f"{extra} beside gate_up_proj and down_proj (biases?), a layout "
                            "expert parallel does not split yet; use ep=1")


def shard(model: nn.Module, plan: Plan, comm: Comm, inner) -> ExpertParallel:
    """Replace each MoE layer's experts module by this rank's share, in place, after slot 1's
    `inner` sharding (tensor parallel, which leaves the experts whole) has run. Collective:
    every rank builds the ep and edp groups together."""
    check(model, plan)
    sub = expert_comm(comm, plan.ep)
    layers = {}
    for name, whole in experts_modules(model).items():
        parent, _, attr = name.rpartition(".")
        layers[name] = ShardedExperts(whole, sub)
        setattr(model.get_submodule(parent) if parent else model, attr, layers[name])
    return ExpertParallel(layers, sub, comm, inner)
