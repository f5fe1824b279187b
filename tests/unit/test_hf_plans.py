"""transformers' tp plans read, derived or refused, and pipeline stages run by the model's own
forward, before any process group (the families' equivalences: tests/multirank/
test_hf_families.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.models import hf, hf_plans
from meshtrain.models.hf_presets import FAMILIES, PRESETS, build
from meshtrain.models.hf_stages import stage_layers
from tests.multirank import equivalence as eq

pytest.importorskip("transformers")

ATTN, MLP = "model.layers.*.self_attn.", "model.layers.*.mlp."


@pytest.mark.parametrize("name", PRESETS)
def test_stages_compute_the_models_own_logits(name):
    torch.manual_seed(0)
    model = build(name)
    ids = torch.randint(0, 256, (2, 16))
    hidden = ids
    for element in stage_layers(model):
        hidden = element(hidden)
    logits = getattr(hidden, "logits", hidden)   # a mixture's: with its routing (moe_stages)
    torch.testing.assert_close(logits, model(ids, use_cache=False).logits, rtol=0, atol=0)


def test_the_configs_styles_map_onto_meshtrains():
    assert hf.tp_plan_of(build("qwen3-tiny"), 2) == {
        ATTN + "q_proj": "column", ATTN + "k_proj": "column", ATTN + "v_proj": "column",
        ATTN + "q_norm": "replicated", ATTN + "k_norm": "replicated", ATTN + "o_proj": "row",
        MLP + "gate_proj": "column", MLP + "up_proj": "column", MLP + "down_proj": "row",
        "model.embed_tokens": "vocab", "lm_head": "vocab"}
    assert hf.tp_plan_of(build("phi3-tiny"), 2) == {
        ATTN + "qkv_proj": "column_gather", ATTN + "o_proj": "row_split",
        MLP + "gate_up_proj": "column_gather", MLP + "down_proj": "row_split",
        "model.embed_tokens": "vocab", "lm_head": "vocab"}


def test_a_family_without_a_plan_gets_one_derived_and_said():
    with pytest.warns(hf_plans.DerivedTpPlanNotice, match="StableLmForCausalLM .* derived"):
        plan = hf.tp_plan_of(build("stablelm-tiny"), 2)
    assert plan == {ATTN + "q_proj": "column_gather", ATTN + "k_proj": "column_gather",
                    ATTN + "v_proj": "column_gather", ATTN + "o_proj": "row_split",
                    MLP + "gate_proj": "column", MLP + "up_proj": "column",
                    MLP + "down_proj": "row", "model.embed_tokens": "vocab", "lm_head": "vocab"}


class OddLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Module()
        self.mix.first, self.mix.second = nn.Linear(8, 16), nn.Linear(16, 8)


def test_projections_whose_names_do_not_settle_it_are_refused_showing_a_plan():
    model = build("stablelm-tiny")
    with pytest.raises(PlanError, match=r"projections \['model.layers.\*.mix.first', "
                                        r"'model.layers.\*.mix.second'\] are not named.*"
                                        r"Plan\(tp_plan="):
        hf_plans.derive(model, "model.layers.*", OddLayer())


def test_a_style_meshtrain_does_not_map_is_refused_naming_module_and_style():
    model = build("qwen3-tiny")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                       "layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(PlanError, match=r"base_model_tp_plan\['layers.\*.mlp.gate_proj'\] = "
                                        r"'packed_colwise'"):
        mt.Trainer(model, mt.Plan(tp=2), eq.sgd)
    assert not dist.is_initialized()


def test_a_norm_beside_split_projections_left_out_of_the_plan_is_refused():
    model = build("qwen3-tiny")
    plan = {k: v for k, v in hf.tp_plan_of(model, 2).items() if not k.endswith("_norm")}
    with pytest.raises(PlanError, match=r"model.layers.0.self_attn.q_norm \(Qwen3RMSNorm\) "
                                        r"has parameters .* add 'model.layers.0.self_attn."
                                        r"q_norm': 'replicated'"):
        mt.Trainer(model, mt.Plan(tp=2, tp_plan=plan), eq.sgd)
    assert not dist.is_initialized()


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_linear_with_a_forward_of_its_own_is_refused():
    model = build("llama-tiny")
    model.model.layers[0].mlp.up_proj = ScaledLinear(64, 128, bias=False)
    with pytest.raises(PlanError, match="model.layers.0.mlp.up_proj is a ScaledLinear: an "
                                        "Linear with a forward of its own"):
        mt.Trainer(model, mt.Plan(tp=2), eq.sgd)


def test_the_families_exercise_what_the_sweep_claims():
    """The presets hold what test_hf_families relies on (else its cells prove less)."""
    gemma = build("gemma2-tiny")
    assert gemma.model.embed_tokens.padding_idx == 0 and gemma.config.sliding_window < 16
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight
    assert gemma.config.final_logit_softcapping is not None
    assert build("gpt-neox-tiny").config.use_parallel_residual
    assert not getattr(build("stablelm-tiny").config, "base_model_tp_plan", None)
    assert len(FAMILIES) >= 6


def test_sequence_parallel_with_a_tp_plan_is_refused_with_pipeline_stages():
    with pytest.raises(PlanError, match="sequence_parallel=True is built for meshtrain's GPT "
                                        "and, with a tp_plan, for transformers causal LMs "
                                        "without pipeline stages"):
        mt.Trainer(build("qwen3-tiny"), mt.Plan(tp=2, pp=2, sequence_parallel=True), eq.sgd)
    assert not dist.is_initialized()
