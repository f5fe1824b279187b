"""Expert parallel without processes: the ep and edp groups carved from the dp groups, and
the refusals that need only the model (strategies/expert_parallel)."""
from __future__ import annotations

import pytest
import torch

from meshtrain.core.mesh import axis_groups, rank_grid
from meshtrain.core.plan import Plan, PlanError
from meshtrain.strategies import expert_parallel
from meshtrain.strategies.expert_parallel.groups import edp_groups, ep_groups


@pytest.mark.parametrize("pp, dp, tp, ep", [(1, 8, 1, 2), (1, 4, 1, 4), (2, 4, 2, 2)])
def test_groups_split_each_dp_group_into_contiguous_ep_and_strided_edp(pp, dp, tp, ep):
    """Within each dp group: dp rank r is ep rank r % ep of the run [r - r % ep, ...) and edp
    rank r // ep of the ranks holding the same experts; each partition covers the group."""
    for ranks in axis_groups(rank_grid(pp, dp, tp), "dp"):
        eps, edps = ep_groups(ranks, ep), edp_groups(ranks, ep)
        assert sorted(r for g in eps for r in g) == sorted(ranks)
        assert sorted(r for g in edps for r in g) == sorted(ranks)
        assert len(eps) == dp // ep and len(edps) == ep
        for r, rank in enumerate(ranks):
            (mine,) = [g for g in eps if rank in g]
            (same,) = [g for g in edps if rank in g]
            assert mine.index(rank) == r % ep and same.index(rank) == r // ep
            assert mine == ranks[r - r % ep:r - r % ep + ep]   # neighbours in dp order
            # the edp group holds the same experts: the same ep rank in every ep group
            assert all(g.index(other) == r % ep for other in same for g in eps if other in g)


def model(name: str):
    from meshtrain.models.hf_presets import config_of
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_of(name))


def test_the_experts_of_every_moe_layer_are_found():
    pytest.importorskip("transformers")
    found = expert_parallel.experts_modules(model("qwen3-moe-tiny"))
    assert sorted(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


@pytest.mark.parametrize("name, plan, message", [
    ("mixtral-tiny", Plan(dp=3, ep=3), "4 experts do not split over 3 ranks"),
    ("llama-tiny", Plan(dp=2, ep=2), "LlamaForCausalLM has none"),
])
def test_refused_by_name_before_any_group(name, plan, message):
    pytest.importorskip("transformers")
    with pytest.raises(PlanError, match=message):
        expert_parallel.check(model(name), plan)
