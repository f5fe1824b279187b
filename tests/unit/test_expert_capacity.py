"""The capacity factor (models/experts.py, [Note: capacity per sequence]): the kept choices
against a plain loop over the rule, the limit on a tiny Mixtral (drops counted, none at a
large factor), and bad input refused before any process group exists."""
from __future__ import annotations

import math

import pytest
import torch

import meshtrain as mt
from meshtrain.core.admit import check_plan
from meshtrain.core.plan import PlanError
from meshtrain.models.experts import experts_modules, kept_choices, limit_capacity


def kept_by_loop(index: torch.Tensor, seq_len: int, experts: int, factor: float) -> list:
    """The rule, spelt out: per sequence, each expert keeps its first ceil(C S K / E)
    choices in token order, then choice rank; index E is no choice at all."""
    k = index.shape[1]
    cap = math.ceil(factor * seq_len * k / experts)
    kept = []
    for start in range(0, index.shape[0], seq_len):
        taken = [0] * experts
        for t in range(start, start + seq_len):
            row = []
            for j in range(k):
                e = int(index[t, j])
                row.append(e < experts and taken[e] < cap)
                if e < experts:
                    taken[e] += 1
            kept.append(row)
    return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.3, 4.0])
def test_kept_choices_follow_the_rule(factor):
    torch.manual_seed(0)
    experts, seq_len, k = 4, 10, 2
    # skewed routing (expert 0 popular) and a few "no expert" entries
    index = torch.multinomial(torch.tensor([4.0, 2, 1, 1, 0.3]), 3 * seq_len * k,
                              replacement=True).view(3 * seq_len, k)
    kept = kept_choices(index, seq_len, experts, factor)
    assert kept.tolist() == kept_by_loop(index, seq_len, experts, factor)
    if factor < 4:
        assert not kept[index < experts].all()   # the case drops something


def test_the_limit_drops_and_counts_on_a_tiny_mixtral():
    pytest.importorskip("transformers")
    from meshtrain.models.hf_presets import build

    torch.manual_seed(0)
    net = build("mixtral-tiny")
    x = torch.randint(0, 255, (3, 16))
    dropless = net(x, use_cache=False).logits
    limit = limit_capacity(net, 1.0)
    limited = net(x, use_cache=False).logits
    counts = limit.take()   # (layers, [routed, dropped])
    layers, k = net.config.num_hidden_layers, net.config.num_experts_per_tok
    assert counts[:, 0].tolist() == [3 * 16 * k] * layers
    assert counts[:, 1].sum() > 0 and not torch.equal(limited, dropless)
    with torch.no_grad():   # evaluation: limited as well, not counted
        net(x, use_cache=False)
    assert limit.take().sum() == 0
    loose = build("mixtral-tiny")
    loose.load_state_dict(net.state_dict())
    limit_capacity(loose, 100.0)   # room for every choice: what dropless computes
    torch.testing.assert_close(loose(x, use_cache=False).logits, dropless, rtol=0, atol=0)


@pytest.mark.parametrize("factor", [0, -1.0, True, "1", math.inf])
def test_a_bad_factor_is_refused(factor):
    with pytest.raises(PlanError, match="capacity_factor=.*must be a number > 0"):
        mt.Plan(capacity_factor=factor)


def test_capacity_is_refused_where_it_cannot_apply():
    with pytest.raises(PlanError, match="GPT has none; drop capacity_factor"):
        from meshtrain.models.gpt import GPT, gpt_config
        mt.Trainer(GPT(gpt_config("tiny")), mt.Plan(capacity_factor=1.0),
                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(PlanError, match="cp with capacity_factor=1.0 is not built yet"):
        check_plan(mt.Plan(cp=2, capacity_factor=1.0))
    with pytest.raises(PlanError, match="capacity_factor=1.0 with dp_mode='dp'"):
        check_plan(mt.Plan(dp=2, dp_mode="dp", capacity_factor=1.0))
    assert experts_modules(torch.nn.Linear(2, 2)) == {}
