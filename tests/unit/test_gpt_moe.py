"""meshtrain's GPT with experts (models/gpt_moe.py), without processes: its mixture computes
what transformers' Mixtral block computes, the dense GPT is untouched, the command line's
--experts / --top-k reach its config, and the planner counts it exactly and verifies it under
expert parallel (the multi-rank equivalences: tests/multirank/test_gpt_moe.py)."""
import argparse

import pytest
import torch

from meshtrain.cli import train_cmd
from meshtrain.cli.train_checks import shape_overrides
from meshtrain.core.plan import Plan
from meshtrain.models import moe
from meshtrain.models.gpt import GPT, GPTConfig, gpt_config
from meshtrain.models.gpt_moe import MoEFeedForward, MoEOutput
from meshtrain.planner.model_spec import preset
from meshtrain.strategies.expert_parallel import experts_modules

SMALL = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_the_mixture_is_mixtrals_sparse_block():
    """Same router and packed experts' weights, same output: softmax over all experts,
    top-2 renormalised, SwiGLU (silu) experts."""
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=32, intermediate_size=64,
                                                 num_local_experts=4, num_experts_per_tok=2))
    mine = MoEFeedForward(32, 64, experts=4, top_k=2)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.1)
    state = theirs.state_dict()
    mine.load_state_dict({"gate.weight": state["gate.weight"],
                          **{k: v for k, v in state.items() if k.startswith("experts.")}})
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(mine(x), theirs(x), rtol=0, atol=1e-6)


def test_dense_gpt_unchanged_and_the_moe_gpt_returns_its_router_logits():
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**SMALL))
    assert GPTConfig().experts == 0 and moe.router_of(dense) is None
    assert isinstance(dense(torch.zeros(2, 8, dtype=torch.long)), torch.Tensor)
    model = GPT(GPTConfig(**SMALL, experts=4, top_k=2))
    out = model(torch.zeros(2, 8, dtype=torch.long))
    assert isinstance(out, MoEOutput) and out.logits.shape == (2, 8, 64)
    assert [t.shape for t in out.router_logits] == [(16, 4)] * SMALL["n_layer"]
    assert moe.router_of(model) == moe.Router(4, 2, 0.02)
    assert moe.router_of(GPT(GPTConfig(**SMALL, experts=4, router_aux_coef=0))).aux_coef is None
    # the packed layout expert parallel splits, under transformers' names
    assert {n: tuple(m.gate_up_proj.shape) + tuple(m.down_proj.shape)
            for n, m in experts_modules(model).items()} == {
        f"blocks.{i}.mlp.experts": (4, 256, 32, 4, 32, 128) for i in range(2)}


def test_the_command_line_shapes_the_experts():
    parser = argparse.ArgumentParser()
    train_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--model", "tiny", "--experts", "8", "--top-k", "1"])
    overrides = shape_overrides(args, is_gpt=True)
    assert overrides == {"experts": 8, "top_k": 1}
    config = gpt_config("tiny", **overrides)
    assert (config.experts, config.top_k) == (8, 1)
    assert (gpt_config("gpt-moe-tiny").experts, gpt_config("gpt-moe-tiny").top_k) == (4, 2)
    with pytest.raises(ValueError, match="top_k=3 routes each token to more experts than the 2"):
        GPTConfig(experts=2, top_k=3)


def test_the_planner_counts_the_moe_preset_exactly():
    torch.manual_seed(0)
    model = GPT(gpt_config("gpt-moe-tiny"))
    spec = preset("gpt-moe-tiny")
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert spec.num_params == params == model.config.num_params()
    # the formula (not the exact count it carries) gives the same, and the experts' share
    formula = spec.embedding_params + spec.layers * spec.layer_params + spec.head_params
    assert formula == params and spec.layers * spec.layer_expert_params == experts
    assert (spec.experts, spec.top_k, spec.mlp) == (4, 2, "swiglu")


def test_verify_runs_an_ep_plan_of_the_moe_preset(capsys, monkeypatch, tmp_path):
    from tests.unit.test_verify_model import _verify_command

    plans, model, err = _verify_command(capsys, monkeypatch, tmp_path, "--model", "gpt-moe-tiny",
                                        "--seq", "64")
    assert model["experts"] == 4
    assert [p for p, _ in plans if Plan(**p).ep > 1] == [
        {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "pp": 2, "microbatches": 4}]   # and under stages
    assert "need a mixture of experts" not in err


def test_mfu_counts_the_experts_a_token_meets():
    """A run's MFU takes 6N over the active parameters (models/experts.active_parameters):
    every parameter but the (experts - top_k) idle experts of each layer, as the planner's
    ModelSpec counts them; a dense model's are all of its parameters."""
    from meshtrain.models.experts import active_parameters
    from meshtrain.models.hf_presets import build
    from meshtrain.planner.model_spec import from_gpt_config, from_transformers_config

    gpt, mixtral = gpt_config("gpt-moe-tiny"), build("mixtral-tiny")
    for model, spec in ((GPT(gpt), from_gpt_config(gpt)),
                        (mixtral, from_transformers_config(mixtral.config))):
        idle = spec.layers * (spec.experts - spec.top_k) * spec.mlp_matrices \
            * spec.hidden * spec.expert_width
        total = sum(p.numel() for p in model.parameters())
        assert idle > 0 and active_parameters(model) == total - idle
    dense = GPT(gpt_config("tiny"))
    assert active_parameters(dense) == sum(p.numel() for p in dense.parameters())
