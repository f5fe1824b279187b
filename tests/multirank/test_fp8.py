"""Float8 training (Plan(precision="fp8"), torchao's float8 linears, emulated on CPU): one
process equals plain torchao float8 training of the same model; every plan equals that one
process within bf16's round-off, 2^-8 at one, on the losses and the fp32 masters:
- DDP, ZeRO-1/2/3, pipeline micro-batches and cp: the float8 scales of activations and
  output gradients come from each rank's (or micro-batch's) part of the batch, so their
  casts round differently; the weights' are one process's (ZeRO-3 gathers them in float8,
  cast as one process casts them: bit for bit its bf16 gather's training,
  test_zero3_float8.py). Measured 2.7e-3 on the masters after 6 steps; after 3, 1.3e-3 (dp=2
  ZeRO-3), 1.7e-3 (cp=2 all-to-all).
- tp: every cast is one process's (the split operands' amax all-reduced over tp: exact on
  the split MLP, `split_layers_against_whole`), but the row layers' partial sums, added
  over tp in bf16, round apart from one process's sum, and a one-ulp bf16 difference
  moves an e4m3 cast by one of its own ulps (2^-3): 1.2e-3 at tp=2 after 3 steps (rowwise:
  5.9e-4 from one rowwise process), where bf16 tp=2 is 2.2e-4 from bf16's one process.
Refused with a clear message without torchao or float8 matmuls."""
import functools

import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.strategies.float8 import check_fp8
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank.test_zero import check_within_bf16_round_off
from tests.multirank.test_zero3_float8 import check_float8_gather, two_ranks as zero3_float8

pytest.importorskip("torchao")
STEPS = 3
FP8 = dict(precision="fp8", fp8_emulate=True)


def float8_config(recipe: str):
    """torchao's config for `recipe`, emulated (as strategies/float8.py builds it)."""
    from torchao.float8 import Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    return Float8LinearConfig(**{**vars(config), "emulate": True})


@functools.cache
def reference_fp8(recipe: str = "tensorwise") -> dict:
    """Plain PyTorch and torchao in one process: bf16 parameters, the GPT's blocks' linears
    converted to torchao's Float8Linear (emulated), fp32 masters, the loss in fp32."""
    from torchao.float8 import convert_to_float8_training

    def convert(net):
        convert_to_float8_training(net, config=float8_config(recipe),
                                   module_filter_fn=lambda m, name: name.startswith("blocks."))
    return eq.reference_bf16("gpt", "sgd", steps=STEPS, convert=convert)


def two_ranks_fp8() -> tuple[list[dict], dict, dict, list[dict], dict]:
    plans = [mt.Plan(dp=2, zero=zero, **FP8) for zero in (0, 1, 3)] + [
        mt.Plan(tp=2, **FP8), mt.Plan(pp=2, microbatches=2, schedule="1f1b", **FP8),
        mt.Plan(cp=2, cp_style="all-to-all", **FP8)]
    rowwise = eq.train(mt.Plan(tp=2, fp8_recipe="rowwise", **FP8), "gpt", "sgd", steps=STEPS)
    return ([eq.train(plan, "gpt", "sgd", steps=STEPS) for plan in plans], rowwise,
            float8_linears(mt.Plan(dp=2, zero=3, **FP8)),
            [split_layers_against_whole(recipe) for recipe in ("tensorwise", "rowwise")],
            zero3_float8())


def four_ranks_fp8() -> list[dict]:
    plans = [mt.Plan(dp=2, tp=2, zero=1, **FP8),
             mt.Plan(dp=2, tp=2, zero=3, sequence_parallel=True, **FP8),
             mt.Plan(pp=2, tp=2, microbatches=2, schedule="zb-h1", **FP8),
             mt.Plan(tp=2, cp=2, cp_style="ring", **FP8),
             mt.Plan(dp=4, zero=3, **FP8),
             mt.Plan(dp=2, pp=2, zero=3, zero3_regather=True, microbatches=2, **FP8),
             mt.Plan(dp=2, pp=2, zero=3, zero3_regather=True, microbatches=2,
                     zero3_fp8_gather=False, **FP8)]
    return [eq.train(plan, "gpt", "sgd", steps=STEPS) for plan in plans]


def float8_linears(plan: mt.Plan) -> dict:
    """The block linears that run in float8 under `plan` on this rank (by module name):
    the round-off check alone would not tell float8 from bf16 on this tiny model."""
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), plan, optimizer=eq.sgd)
    names = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    trainer.close()
    return {"float8": names}


def split_layers_against_whole(recipe: str) -> dict:
    """At tp=2, the first MLP's column-parallel fc and row-parallel proj against torchao's
    Float8Linear holding the whole weight, on one input and output gradient. "exact": the
    largest difference of each product that needs no sum over tp (the fc's output and
    weight gradient, the proj's weight and input gradients); "summed": of those summed over
    tp (the fc's input gradient, the proj's output), over the largest value. Each rank must
    cast with the whole tensor's scales: with each slice's own, tensorwise's exact products
    move up to 2.06 and its summed ones 2^-4 (measured). (Rowwise rounds its scales down
    to powers of two, which scale float8's grid exactly: its numbers come out the same
    with either amax here.)"""
    from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), mt.Plan(tp=2, fp8_recipe=recipe, **FP8), optimizer=eq.sgd)
    full, rank = trainer.full_state_dict(), trainer.mesh.axis_rank("tp")
    exact, summed = [], []
    for name in ("fc", "proj"):
        layer = getattr(trainer.model.blocks[0].mlp, name)
        whole = nn.Sequential(nn.Linear(layer.full_in, layer.full_out, bias=False))
        whole[0].weight.data.copy_(full[f"blocks.0.mlp.{name}.weight"])
        convert_to_float8_training(whole.to(torch.bfloat16), config=float8_config(recipe))
        torch.manual_seed(1)
        x = torch.randn(4, 16, layer.full_in, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(4, 16, layer.full_out, dtype=torch.bfloat16)
        y = whole(x)
        y.backward(grad)
        dw = whole[0].weight.grad
        if name == "fc":   # column: x whole; y, dy and the weight's rows sliced
            mine = slice(rank * layer.out_features, (rank + 1) * layer.out_features)
            x_in = x.detach().requires_grad_()
            y_mine = layer(x_in)
            dw_mine, dx = torch.autograd.grad(y_mine, [layer.weight, x_in], grad[..., mine])
            pairs, sums = [(y_mine, y[..., mine]), (dw_mine, dw[mine])], [(dx, x.grad)]
        else:              # row: x and the weight's columns sliced, y summed over tp
            mine = slice(rank * layer.in_features, (rank + 1) * layer.in_features)
            x_mine = x.detach()[..., mine].requires_grad_()
            y_sum = layer(x_mine)
            dw_mine, dx_mine = torch.autograd.grad(y_sum, [layer.weight, x_mine], grad)
            pairs = [(dw_mine, dw[:, mine]), (dx_mine, x.grad[..., mine])]
            sums = [(y_sum, y)]
        exact += [(a - b).abs().max().item() for a, b in pairs]
        summed += [((a - b).abs().max() / b.abs().max()).item() for a, b in sums]
    trainer.close()
    return {"exact": exact, "summed": summed}


def test_fp8_one_process_is_torchaos_and_dp_zero3_tp_pp_cp_within_round_off():
    ref = reference_fp8()
    one = eq.train(mt.Plan(**FP8), "gpt", "sgd", steps=STEPS)
    torch.testing.assert_close(one["losses"], ref["losses"])   # fp32's tolerances
    torch.testing.assert_close(one["state"], ref["state"])
    bf16 = eq.reference_bf16("gpt", "sgd", steps=STEPS)
    gap = max((bf16["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert gap > 1e-4   # float8 really ran: it trains apart from bf16
    blocks = [f"blocks.{i}.{m}" for i in range(2)
              for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")]
    for rank, (results, rowwise, zero3, split, gather) in enumerate(
            run_ranks(2, two_ranks_fp8, timeout=200)):
        for result in results:   # DDP, ZeRO-1, ZeRO-3, tp, pp, cp
            check_within_bf16_round_off(result, ref)
        # ZeRO-3's weights gathered in float8 (eager: results[2]) against bf16's
        check_float8_gather(gather, results[2], rank)
        check_within_bf16_round_off(rowwise, reference_fp8("rowwise"))   # tp
        assert zero3["float8"] == blocks   # ZeRO-3 gathers into torchao's own linears
        for products in split:   # one process's casts, tensorwise and rowwise
            assert products["exact"] == [0.0] * 4
            assert max(products["summed"]) < 2 ** -7   # bf16's sums over tp: 4.7e-3


def test_fp8_under_tp_with_dp_pp_cp_zero3_and_sequence_parallel_within_round_off():
    ref = reference_fp8()
    for results in run_ranks(4, four_ranks_fp8, timeout=200):
        for result in results:   # dp2xtp2 ZeRO-1, dp2xtp2 ZeRO-3 sp, pp2xtp2, tp2xcp2, dp4,
            # dp2xpp2 ZeRO-3 regathered (weights gathered in float8, then in bf16)
            check_within_bf16_round_off(result, ref)
        float8, bf16 = results[-2:]   # the same casts: bit for bit
        assert float8["losses"] == bf16["losses"]
        assert all(torch.equal(float8["state"][k], v) for k, v in bf16["state"].items())


def test_fp8_compiled_blocks_equal_eager():
    """Each block compiled (aot_eager: dynamo and AOT autograd through torchao's float8
    linears and tensor subclass, no code generated) runs the eager float8 numbers exactly.
    (Inductor, checked by hand: 8.5e-4 from eager on the masters after 3 steps, its fused
    casts rounding apart; 35 s to compile on a CPU, too slow to test here.)"""
    from tests.multirank.test_compile import STEPS as COMPILED_STEPS, train_counted

    (compiled,) = train_counted([dict(compile="aot_eager", **FP8)])
    eager = eq.train(mt.Plan(**FP8), "gpt", "sgd", steps=COMPILED_STEPS)
    eq.assert_equivalent(compiled, eager, what="fp8 compiled")
    assert compiled["runs"] >= COMPILED_STEPS and compiled["graphs"] >= 1   # ran compiled
    assert compiled["breaks"] == 0


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(mt.PlanError, match="precision='fp8' on the CPU: a CPU has no float8 "
                                           "matmuls; emulate them with fp8_emulate=True"):
        check_fp8("fp8", False, "cpu")
    with pytest.raises(mt.PlanError, match=r"precision='fp8' on NVIDIA A100 \(compute "
                                           r"capability 8.0\): float8 matmuls need 8.9"):
        check_fp8("fp8", False, "cuda", (8, 0), "NVIDIA A100")
    check_fp8("fp8", False, "cuda", (9, 0), "NVIDIA H100")   # Hopper runs it
    from meshtrain.core.admit import check_plan
    with pytest.raises(mt.PlanError, match="precision='fp8' with compile='cudagraphs': "
                                           "float8 training is compiled with inductor"):
        check_plan(mt.Plan(compile="cudagraphs", **FP8))
    with pytest.raises(mt.PlanError, match="fp8_recipe / fp8_emulate .* need precision='fp8'"):
        mt.Plan(fp8_emulate=True)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(mt.PlanError, match=r"torchao's float8, which is not installed; pip "
                                           r"install 'meshtrain\[fp8\]'"):
        check_fp8("fp8", True, "cpu")


@pytest.mark.parametrize("recipe, scaling", [("tensorwise", "dyn_ten"), ("rowwise", "dyn_axs")])
def test_the_blocks_linears_run_in_float8_the_output_layer_in_bf16(recipe, scaling):
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.MODELS["gpt"][0](), mt.Plan(**FP8, fp8_recipe=recipe),
                         optimizer=eq.sgd)
    blocks = [n for n, m in trainer.model.named_modules()
              if isinstance(m, nn.Linear) and n.startswith("blocks.")]
    assert trainer.float8 == blocks and blocks   # every block's linear, nothing after them
    q = trainer.model.blocks[0].attn.q
    assert f"i:{scaling}_e4m3" in repr(q) and q.weight.dtype == torch.bfloat16
