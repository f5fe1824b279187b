"""Activation recomputation: the same numbers as one process under DDP and ZeRO-3, and the
activation bytes a layer keeps equal to the planner's formula for each mode."""
import pytest
import torch

import meshtrain as mt
from meshtrain.core.memory import ActivationMeter
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner.activations import layer_activation_bytes
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.strategies.recompute import apply_recompute
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

CASES = [(zero, mode, model) for zero in (0, 3) for mode, model in
         (("full", "gpt"), ("selective", "gpt"), ("full", "tied"))] + [
    (0, "attention", "gpt"), (3, "full/2", "gpt")]   # "full/2": every second layer


def recompute_cases(microbatches: int) -> dict:
    return {(zero, mode, model): eq.train(mt.Plan(dp=eq.world_size(), zero=zero,
                                                  recompute=mode.split("/")[0],
                                                  recompute_every=int((mode + "/1").split("/")[1]),
                                                  microbatches=microbatches), model, "sgd",
                                          max_grad_norm=1.0)
            for zero, mode, model in CASES}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_recomputation_matches_one_process(world, microbatches):
    refs = {model: eq.reference(model, "sgd", max_grad_norm=1.0) for model in ("gpt", "tied")}
    for results in run_ranks(world, recompute_cases, microbatches, timeout=120):
        for (zero, mode, model), result in results.items():
            eq.assert_equivalent(result, refs[model], what=f"zero={zero} recompute={mode} {model}")


CONFIG = GPTConfig(vocab_size=256, seq_len=128, n_layer=3, n_head=4, d_model=256)


@pytest.mark.parametrize("mode", ["none", "full", "attention", "selective"])
def test_a_layer_keeps_what_the_planner_predicts(mode):
    """Measured: the bytes autograd (and recomputation) keep for one transformer layer's
    backward; predicted: Korthikanti et al. 2022's per-layer formula in the planner (fp32,
    fused attention: none 16 sbh, attention 16 sbh, full 1 sbh elements), per op for
    selective (11 sbh)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    meter = ActivationMeter(model.parameters())
    wrapped = apply_recompute(model, mode, meter.keep)
    assert ("blocks.0" in wrapped) == (mode in ("full", "selective"))
    assert ("blocks.0.attn.core" in wrapped) == (mode == "attention")
    b, s = 4, CONFIG.seq_len
    x = model.embed(torch.randint(0, CONFIG.vocab_size, (b, s))).detach().requires_grad_()
    with meter.measure():
        model.blocks[0](x)
    predicted = layer_activation_bytes(from_gpt_config(CONFIG, "gpt"), s, b, recompute=mode,
                                       elem_bytes=4)
    assert meter.last_bytes == pytest.approx(predicted, rel=0.05)
    if mode == "full":   # only the layer's input: s*b*h elements
        assert meter.last_bytes == x.numel() * 4


def test_attention_recomputation_needs_attention_cores():
    with pytest.raises(mt.PlanError, match="recompute='attention' recomputes attention cores, "
                                           "and Sequential exposes none"):
        mt.Trainer(eq.tied_sequential(), mt.Plan(recompute="attention"), optimizer=eq.sgd,
                   loss_fn=eq.token_loss)


def test_an_unknown_recompute_mode_is_refused():
    with pytest.raises(mt.PlanError, match="Plan.recompute='some'"):
        mt.Plan(recompute="some")


# meshtrain's GPT with gpt2-124m's ratios at a CPU-sized scale: vocab / d_model 64 (the
# fp32 logits the last layer keeps are then as large a share of the activations as on
# GPT-2), seq_len / d_model 1, head_dim 64 (fewer layers)
RATIO_CONFIG = GPTConfig(vocab_size=4096, seq_len=64, n_layer=3, n_head=1, d_model=64)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_whole_step_keeps_what_the_planner_predicts(precision):
    """The bytes a whole training step keeps for backward (every layer, the head's fp32
    logits, recomputation's kept inputs), measured by the Trainer's meter, against the
    planner's activation term for the same plan: with and without full recomputation, and
    so the fraction full recomputation saves."""
    from meshtrain.planner.memory import memory
    from meshtrain.measure.verify import plan_inputs

    kept, predicted = {}, {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        plan = {"precision": precision, "recompute": mode}
        trainer = mt.Trainer(GPT(RATIO_CONFIG), mt.Plan(**plan, measure_activations=True),
                             optimizer=eq.sgd)
        batch = torch.randint(0, RATIO_CONFIG.vocab_size, (2, 2, RATIO_CONFIG.seq_len))
        trainer.step(batch[0], batch[1])
        kept[mode] = trainer.activations.last_bytes
        spec, cand, setup = plan_inputs(plan, 2, vars(RATIO_CONFIG))
        predicted[mode] = memory(spec, cand, setup).activations
        assert kept[mode] == pytest.approx(predicted[mode], rel=0.02), mode
    # what full recomputation saves; what it leaves: the layers' inputs and what the loss
    # keeps of the logits (a large share with GPT-2's vocabulary, most of what is left): the
    # fp32 logits without recomputation, their gradient in the compute dtype with it (the
    # lean loss)
    saved = 1 - kept["full"] / kept["none"]
    assert saved == pytest.approx(1 - predicted["full"] / predicted["none"], abs=0.02)
    tokens = 2 * RATIO_CONFIG.seq_len * RATIO_CONFIG.vocab_size
    head = (4 if precision == "fp32" else 2) * tokens
    assert head < kept["full"] and kept["full"] - head < 0.1 * kept["full"]
    assert kept["none"] > 4 * tokens
