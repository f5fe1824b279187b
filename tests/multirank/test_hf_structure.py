"""What meshtrain reads from a transformers causal LM's structure: recomputation and ZeRO-3
per decoder layer, the heads tensor parallel needs, aliases it refuses; and the
`self.layers = nn.ModuleList` attribute that is not a layers() method."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.measure.trained_model import model_of
from meshtrain.models.hf_presets import build
from meshtrain.models.structure import units_of
from meshtrain.planner.activations import layer_activation_bytes
from meshtrain.testing import RankError, run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases

pytest.importorskip("transformers")


def _activation_bytes(recompute: str) -> int:
    torch.manual_seed(0)
    trainer = mt.Trainer(build("llama-tiny"),
                         mt.Plan(recompute=recompute, measure_activations=True), eq.sgd)
    x, y = eq.batches("llama-tiny", 1)[0]
    trainer.step(x, y)
    return trainer.memory_report().activations, trainer.recomputed


def test_recompute_per_decoder_layer_keeps_only_each_layers_input():
    plain, none = _activation_bytes("none")
    recomputed, names = _activation_bytes("full")
    assert none == [] and names == ["model.layers.0", "model.layers.1"]   # every one
    # each decoder layer keeps its input (b*s*h fp32) in place of what the planner's trace
    # says it saves (RoPE's two s x head_dim tables, saved once per batch, aside)
    x, _ = eq.batches("llama-tiny", 1)[0]
    b, s = x.shape
    spec = model_of("llama-tiny", s)
    freed = 2 * (layer_activation_bytes(spec, s, b, elem_bytes=4)
                 - layer_activation_bytes(spec, s, b, recompute="full", elem_bytes=4))
    tables = 2 * 2 * s * (spec.hidden // spec.heads) * 4
    assert plain - recomputed == pytest.approx(freed + tables, rel=1e-3), (plain, recomputed)


def zero3_units() -> dict:
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf_presets import config_of

    config = config_of("llama-tiny")
    config.num_hidden_layers = 4   # enough layers to see them come and go
    torch.manual_seed(0)
    trainer = mt.Trainer(AutoModelForCausalLM.from_config(config), mt.Plan(dp=2, zero=3),
                         eq.sgd)
    x, y = eq.batches("llama-tiny", 1, trainer.dp_rank, trainer.dp_size)[0]
    trainer.step(x, y)
    units = {u.name: u.nbytes for u in trainer.data_parallel.units}
    return {"units": units, "peak": trainer.memory_report().gathered_peak}


def test_zero3_gathers_one_decoder_layer_at_a_time():
    for out in run_ranks(2, zero3_units, timeout=60):
        units = out["units"]
        assert list(units) == [f"model.layers.{i}" for i in (3, 2, 1, 0)] + ["root"]
        layer = units["model.layers.0"]
        # the root (embedding, norm, output layer) stays gathered through forward; of the
        # four decoder layers two at once (one in use, the next prefetched), never all
        assert out["peak"] == units["root"] + 2 * layer
        assert out["peak"] < sum(units.values()) - layer


def test_heads_that_tp_does_not_divide_are_refused_before_any_process_group():
    assert not dist.is_initialized()
    with pytest.raises(PlanError, match="tp=4 does not divide the 2 key/value heads"):
        mt.Trainer(build("llama-tiny"), mt.Plan(tp=4), eq.sgd)
    with pytest.raises(PlanError, match="pp=8 x virtual_stages=1 = 8 stages, but "
                                        "LlamaForCausalLM has only 4 layers"):
        mt.Trainer(build("llama-tiny"), mt.Plan(pp=8), eq.sgd)
    assert not dist.is_initialized()


class PlainListWrapper(nn.Module):
    """The wrapper the issue found: the model registered, its stages in a plain list."""

    def __init__(self):
        super().__init__()
        self.lm = build("llama-tiny")
        base = self.lm.model
        self.stages = [base.embed_tokens, *base.layers, base.norm, self.lm.lm_head]

    def forward(self, idx):
        return self.lm(idx).logits


def alias_refused():
    torch.manual_seed(0)
    plan = {"lm.model.layers.*.mlp.up_proj": "column", "lm.model.layers.*.mlp.gate_proj":
            "column", "lm.model.layers.*.mlp.down_proj": "row", "lm.model.embed_tokens": "vocab"}
    mt.Trainer(PlainListWrapper(), mt.Plan(tp=2, tp_plan=plan), eq.sgd, loss_fn=eq.token_loss)


def test_an_alias_of_a_module_tp_split_is_refused():
    with pytest.raises(RankError, match=r"PlainListWrapper.stages\[0\] still refers to "
                                          r"lm.model.embed_tokens"):
        run_ranks(2, alias_refused, timeout=60)


class WithModuleList(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 37)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_a_layers_module_list_attribute_is_not_a_layers_method():
    model = WithModuleList()
    assert units_of(model) == [model.embed, *model.layers, model.head]   # never the list
    trainer = mt.Trainer(model, mt.Plan(recompute="full", zero=3), eq.sgd, loss_fn=eq.token_loss)
    x = torch.randint(0, 37, (4, 9))
    assert trainer.recomputed == ["embed", "layers.0", "layers.1", "layers.2"]
    assert [u.name for u in trainer.data_parallel.units] == [
        "head", "layers.2", "layers.1", "layers.0", "embed"]
    assert torch.isfinite(torch.tensor(trainer.step(x[:, :-1], x[:, 1:])))


def resume_under_another_plan(folder: str) -> dict:
    model = "llama-tiny-tied"
    steps = eq.batches(model, 4)
    torch.manual_seed(0)
    first = mt.Trainer(build(model), mt.Plan(tp=2), eq.sgd)
    losses = [first.step(x, y) for x, y in steps[:2]]
    first.save(folder)
    torch.manual_seed(1)   # other initial weights: the checkpoint must replace them all
    second = mt.Trainer(build(model), mt.Plan(pp=2, microbatches=2), eq.sgd)
    second.load(folder)
    losses += [second.step(x, y) for x, y in steps[2:]]
    return {"losses": losses, "state": second.full_state_dict(),
            "optimizer": second.full_optimizer_state()["state"], "norms": []}


def test_a_checkpoint_under_tp_resumes_under_pp_to_one_process_numbers(tmp_path):
    ref = hf_cases.reference("llama-tiny-tied", steps=4)
    for result in run_ranks(2, resume_under_another_plan, str(tmp_path / "ckpt"), timeout=90):
        eq.assert_equivalent(result, ref, what="tp=2 then pp=2")


def readme_gpt2(tp: int) -> dict:
    """The README's transformers GPT-2 example (its loss_fn and tp_plan), in bf16."""
    from meshtrain.strategies.tensor_parallel import token_cross_entropy

    torch.manual_seed(0)
    trainer = mt.Trainer(eq.hf_gpt2(), mt.Plan(tp=tp, precision="bf16",
                                               tp_plan=eq.HF_GPT2_TP_PLAN if tp > 1 else None),
                         eq.sgd, loss_fn=token_cross_entropy)
    losses = [trainer.step(x, y) for x, y in eq.batches("hf_gpt2", 3)]
    return {"losses": losses, "state": trainer.full_state_dict()}


def test_readme_gpt2_example_runs_in_bf16_under_tp():
    from tests.multirank.test_hf_models import check_bf16

    one = readme_gpt2(1)   # bit for bit plain torch's bf16 (test_hf_models, hf-gpt2-tiny)
    for result in run_ranks(2, readme_gpt2, 2, timeout=60):
        check_bf16(result, one, exact=False, what="README GPT-2, tp=2, bf16")


def test_the_tp_plan_is_the_configs_own_mapped_onto_meshtrain_styles():
    from meshtrain.models import hf

    attn, mlp = "model.layers.*.self_attn.", "model.layers.*.mlp."
    assert hf.tp_plan_of(build("qwen2-tiny"), 2) == {
        attn + "q_proj": "column", attn + "k_proj": "column", attn + "v_proj": "column",
        attn + "o_proj": "row", mlp + "gate_proj": "column", mlp + "up_proj": "column",
        mlp + "down_proj": "row", "model.embed_tokens": "vocab", "lm_head": "vocab"}
    assert hf.tp_plan_of(build("hf-gpt2-tiny"), 2) == hf.GPT2_TP_PLAN == eq.HF_GPT2_TP_PLAN
