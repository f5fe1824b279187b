"""Pipeline stages balanced by training compute (Plan.stage_balance="compute", the default):
each layer weighed by its forward + backward FLOPs per token, the split checked against the
optimum found here by trying every cut, from the formulas written out by hand. The planner
predicts the same split from the model spec."""
from itertools import combinations

import pytest
import torch

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.models.layer_compute import layer_flops
from meshtrain.models.registry import build_model
from meshtrain.planner import preset
from meshtrain.planner.stage_split import stage_blocks
from meshtrain.strategies.pipeline.partition import model_layers, stage_bounds

LOSS = 8   # FLOPs per logit the loss is counted at (core/stage_split.LOSS_FLOPS_PER_LOGIT)


def optimum(weights, stages):
    """Every way to cut `weights` into `stages` non-empty runs: the lightest heaviest run,
    and the bounds of each cut that reaches it."""
    n, best, where = len(weights), float("inf"), []
    for inner in combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        if heaviest < best:
            best, where = heaviest, [bounds]
        elif heaviest == best:
            where.append(bounds)
    return best, where


def gpt2_124m_by_hand():
    V, d, L, T = 50304, 768, 12, 1024
    block = 6 * (4 * d * d + 8 * d * d) + 12 * T * d   # q k v o, the 4d MLP; attention
    return [0, *[block] * L, 6 * V * d + LOSS * V]       # the lookup; the head and the loss


@pytest.fixture(scope="module")
def gpt2():
    with torch.device("meta"):
        return build_model("gpt2-124m", {}).module


def test_gpt2_layers_weigh_their_flops(gpt2):
    assert layer_flops(gpt2, model_layers(gpt2)) == pytest.approx(gpt2_124m_by_hand())


@pytest.mark.parametrize("pp, expected", [(2, [0, 9, 14]), (4, [0, 5, 9, 13, 14])])
def test_gpt2_124m_split_is_the_compute_optimum(gpt2, pp, expected):
    best, where = optimum(gpt2_124m_by_hand(), pp)
    assert where == [expected]   # one optimum: the head is worth ~4.5 blocks
    assert stage_bounds(gpt2, mt.Plan(pp=pp)) == expected
    # by parameters the 38.6M-parameter embedding pushes blocks off stage 0
    by_params = stage_bounds(gpt2, mt.Plan(pp=pp, stage_balance="parameters"))
    assert by_params[1] < expected[1]
    # the planner cuts the spec as the pipeline cuts the modules
    spec = preset("gpt2-124m")
    assert stage_blocks(spec, mt.Plan(pp=pp)) == [min(b, 13) - max(a, 1) for a, b in
                                                   zip(expected, expected[1:])]


@pytest.mark.parametrize("tied", [False, True])
def test_llama_with_a_large_vocabulary(tied):
    import transformers as tf
    V, h, inter, heads, kv, L, T = 8192, 64, 128, 4, 2, 6, 128
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=h, intermediate_size=inter,
                         num_hidden_layers=L, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=T,
                         tie_word_embeddings=tied)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    kv_dim = kv * h // heads
    block = 6 * (2 * h * h + 2 * h * kv_dim + 3 * h * inter) + 12 * T * h
    weights = [0, *[block] * L, 6 * V * h + LOSS * V]   # tied: the head still multiplies
    assert layer_flops(model, model_layers(model)) == pytest.approx(weights)
    for pp in (2, 3):
        best, where = optimum(weights, pp)
        bounds = stage_bounds(model, mt.Plan(pp=pp))
        assert bounds in where
        assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == best


def test_stage_balance_refuses_other_values():
    with pytest.raises(PlanError, match=r"Plan.stage_balance='flops': choose one of "
                                        r"'compute', 'parameters'"):
        mt.Plan(pp=2, stage_balance="flops")
