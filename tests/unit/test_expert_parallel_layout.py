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
    for ranks in axis_groups(rank_grid(pp, dp, 1, tp), "dp"):
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


def test_one_rank_dispatch_computes_what_the_replaced_module_computes():
    """ep = 1 (the all-to-alls copy): ShardedExperts sorts, splits, computes and combines the
    routed rows to transformers' own experts module's output and gradients, an index E
    ("no expert", which transformers skips) included."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from meshtrain.core.comm import Comm
    from meshtrain.core.mesh import Mesh
    from meshtrain.models.hf_presets import config_of
    from meshtrain.strategies.expert_parallel.dispatch import ShardedExperts
    from meshtrain.strategies.expert_parallel.groups import expert_comm

    config = config_of("mixtral-tiny")
    torch.manual_seed(0)
    whole = MixtralExperts(config)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.1)
    mine = ShardedExperts(whole, expert_comm(Comm(Mesh.build(Plan())), 1))
    hidden = torch.randn(12, config.hidden_size, requires_grad=True)
    weights, index = torch.softmax(torch.randn(12, 4), -1).topk(2, dim=-1)
    index[3, 1] = 4   # no expert for this row
    weights = weights.detach().requires_grad_()
    outs = [m(hidden, index, weights) for m in (whole, mine)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    grads = [torch.autograd.grad(o.square().sum(), (hidden, weights, m.gate_up_proj,
                                                    m.down_proj))
             for o, m in zip(outs, (whole, mine))]
    for ours, theirs in zip(grads[1], grads[0]):   # fp32 round-off: sums in another order
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert mine.take_counts()[1].tolist() == torch.bincount(
        index[index < 4], minlength=4).tolist()
