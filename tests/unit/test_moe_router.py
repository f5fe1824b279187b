"""A mixture of experts' router loss (meshtrain/models/moe.py), without processes: what one
process computes on the global batch against what dp shards give, and the refusals."""
from __future__ import annotations

import pytest
import torch

from meshtrain.core.plan import Plan, PlanError
from meshtrain.models import moe

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

EXPERTS, TOP_K, LAYERS, TOKENS = 4, 2, 2, 24


def router_logits(seed: int) -> tuple[torch.Tensor, ...]:
    """Skewed router logits (expert 0 preferred), one (TOKENS, EXPERTS) tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    skew = torch.tensor([1.0, 0.0, 0.0, -0.5])
    return tuple((torch.randn(TOKENS, EXPERTS, generator=g) + skew).requires_grad_()
                 for _ in range(LAYERS))


def shard(layers, half: int):
    """dp rank `half`'s tokens of every layer (the batch split in two along its rows)."""
    return tuple(t[half * TOKENS // 2:(half + 1) * TOKENS // 2] for t in layers)


def test_over_dp_shards_the_aux_loss_and_its_gradient_are_the_global_batchs():
    """Two shards, each with the counts of both summed in (the dp all-reduce): the mean of
    their aux losses is transformers' on the whole batch, and so are the gradients of the
    router logits; each shard's own aux, averaged, is not (the reason counts are summed)."""
    whole = router_logits(0)
    expected = load_balancing_loss_func(whole, EXPERTS, TOP_K)
    grads = torch.autograd.grad(expected, whole)
    router = moe.Router(EXPERTS, TOP_K, 0.02)
    mine = [moe.RouterLoss(None, router, None) for _ in range(2)]
    # each rank's counts: what the all-reduce would sum, computed on the other shard
    other = [mine[1 - h].routed(shard(whole, 1 - h))[0] for h in range(2)]
    for h, loss in enumerate(mine):
        loss.reduce_counts = lambda counts, h=h: counts.add_(other[h])
    shards = [loss.balancing(shard(whole, h), global_counts=True) for h, loss in enumerate(mine)]
    mean = (shards[0] + shards[1]) / 2
    torch.testing.assert_close(mean, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.autograd.grad(mean, whole), grads, rtol=1e-6, atol=1e-9)
    own = [moe.RouterLoss(None, router, None).balancing(shard(whole, h), global_counts=False)
           for h in range(2)]
    assert abs((own[0] + own[1]).item() / 2 - expected.item()) > 1e-4   # not the same loss


def tiny_mixtral(**config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
            vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
            **{"num_experts_per_tok": 2, "output_router_logits": True, **config}))


@pytest.mark.parametrize("plan, config, message", [
    (Plan(tp=2, sequence_parallel=True), {}, "its experts stay whole over tp"),
    (Plan(pp=2, compile=True), {}, "compiled mixture-of-experts layers are not built under"),
    (Plan(dp=2, dp_mode="dp"), {}, "only dp_mode='ddp' (DDP, ZeRO) gathers"),
    (Plan(dp=2), {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than its 4 experts"),
])
def test_what_a_mixture_of_experts_cannot_run_is_refused_by_name(plan, config, message):
    with pytest.raises(PlanError, match="MixtralForCausalLM \\(4 experts") as raised:
        moe.check(tiny_mixtral(**config), plan)
    assert message in str(raised.value)


def test_without_router_logits_no_loss_is_added_and_other_dp_modes_run():
    model = tiny_mixtral(output_router_logits=False)
    assert moe.router_of(model) == moe.Router(4, 2, None)
    assert moe.router_loss(model, None, None) is None
    moe.check(model, Plan(dp=2, dp_mode="dp"))   # no router loss to gather: as dense models
    assert moe.router_of(torch.nn.Linear(2, 2)) is None
