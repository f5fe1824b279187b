"""A mixture of experts' routing carried through pipeline stages (models/moe_stages.py), in
one process: the transformers Mixtral cut into its stage elements, each one a stage (a
boundary after every element, crossed as the pipeline's runtime crosses it:
strategies/pipeline/boundary.py), gives the loss and every gradient that the model's own
forward and transformers' load-balancing loss give. The aux loss's gradient enters only
through the prob_sum carried to the head (over three boundaries from layer 0's router), so
a carried gradient lost on the way changes the routers' gradients (checked by hand:
detaching the routing in `RouterTap.add`, or dropping the second tensor's gradient in
`boundary.input_gradients`, fails the first test)."""
from __future__ import annotations

import pytest
import torch

from meshtrain.models import moe
from meshtrain.models.hf_presets import build
from meshtrain.models.hf_stages import stage_layers
from meshtrain.models.registry import token_cross_entropy
from meshtrain.strategies.pipeline import boundary

pytest.importorskip("transformers")


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def one_process(model, x, y) -> tuple[torch.Tensor, dict]:
    """What transformers computes: cross-entropy + coef x its own aux, and the gradients."""
    output = model(x, use_cache=False)
    loss = token_cross_entropy(output, y) + model.config.router_aux_loss_coef * output.aux_loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def through_stages(model, x, y) -> tuple[torch.Tensor, dict]:
    """Every element its own stage: forward hands each the previous one's output detached
    (as received), backward hands each the gradient of its input the next one computed."""
    loss_fn = moe.router_loss(model, token_cross_entropy, lambda counts: None)
    value, held = x, []
    for element in stage_layers(model):
        received = value if value is x else boundary.detached(value)
        if received is not x:
            boundary.mark_inputs(received)
        value = element(received)
        held.append((received, value))
    loss = loss_fn(value, y)
    grad = None
    for received, output in reversed(held):
        boundary.backward(loss if grad is None else output, grad)
        if received is x:
            break
        grad = boundary.input_gradients(received)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_carried_routing_gives_one_process_loss_and_gradients():
    torch.manual_seed(0)
    model = build("mixtral-tiny")
    x, y = batch(model.config.vocab_size)
    expected, grads = one_process(model, x, y)
    model.zero_grad(set_to_none=True)
    loss, mine = through_stages(model, x, y)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    router = "model.layers.0.mlp.gate.weight"
    assert router in grads
    for name, grad in grads.items():   # fp32 round-off between two orders of the same sums
        torch.testing.assert_close(mine[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_router_loss_moves_the_first_routers_gradient_beyond_the_tolerance():
    """The case above proves something: without the router's loss (coefficient 0), layer
    0's router gradient differs from the one with it by far more than the tolerance."""
    torch.manual_seed(0)
    model = build("mixtral-tiny")
    x, y = batch(model.config.vocab_size)
    _, with_aux = one_process(model, x, y)
    model.zero_grad(set_to_none=True)
    model.config.router_aux_loss_coef = 0.0
    _, without = one_process(model, x, y)
    router = "model.layers.0.mlp.gate.weight"
    assert (with_aux[router] - without[router]).abs().max() > 1e-4


def test_a_family_whose_router_logits_are_not_recorded_is_refused_under_pp(monkeypatch):
    """The routing is read where transformers records it; a family that declares no
    recorder is refused by name under pp (and still runs at pp=1)."""
    from meshtrain.core.plan import Plan, PlanError

    with torch.device("meta"):
        model = build("mixtral-tiny")
    assert moe.router_recorder(model)[1] == 0
    monkeypatch.setattr(type(model.base_model), "_can_record_outputs", {})
    moe.check(model, Plan(dp=2))
    with pytest.raises(PlanError, match="_can_record_outputs\\['router_logits'\\]"):
        moe.check(model, Plan(pp=2))
