"""Float8 training (Plan(precision="fp8"), torchao's float8 linears, emulated on CPU): one
process equals plain torchao float8 training of the same model; DDP, ZeRO-1 and ZeRO-3 equal
that one process within bf16's round-off (their float8 scales for activations and output
gradients come from each rank's half of the batch, so their casts round differently; the
weights' scales are one process's, ZeRO-3 gathering the same bf16 weights DDP holds:
measured 2.7e-3 on the masters after 6 steps, 1.3e-3 after 3 under ZeRO-3, within bf16's
2^-8 at one); refused with a clear message without torchao or float8 matmuls."""
import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.strategies.float8 import check_fp8
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank.test_zero import check_within_bf16_round_off

pytest.importorskip("torchao")
STEPS = 3
FP8 = dict(precision="fp8", fp8_emulate=True)


def reference_fp8() -> dict:
    """Plain PyTorch and torchao in one process: bf16 parameters, the GPT's blocks' linears
    converted to torchao's Float8Linear (emulated), fp32 masters, the loss in fp32."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def convert(net):
        convert_to_float8_training(net, config=Float8LinearConfig(emulate=True),
                                   module_filter_fn=lambda m, name: name.startswith("blocks."))
    return eq.reference_bf16("gpt", "sgd", steps=STEPS, convert=convert)


def data_parallel_fp8() -> list[dict]:
    return [eq.train(mt.Plan(dp=2, zero=zero, **FP8), "gpt", "sgd", steps=STEPS)
            for zero in (0, 1, 3)] + [float8_linears(mt.Plan(dp=2, zero=3, **FP8))]


def float8_linears(plan: mt.Plan) -> dict:
    """The block linears that run in float8 under `plan` on this rank (by module name):
    the round-off check alone would not tell float8 from bf16 on this tiny model."""
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), plan, optimizer=eq.sgd)
    names = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    trainer.close()
    return {"float8": names}


def test_fp8_one_process_is_torchaos_and_ddp_zero1_zero3_within_round_off():
    ref = reference_fp8()
    one = eq.train(mt.Plan(**FP8), "gpt", "sgd", steps=STEPS)
    torch.testing.assert_close(one["losses"], ref["losses"])   # fp32's tolerances
    torch.testing.assert_close(one["state"], ref["state"])
    bf16 = eq.reference_bf16("gpt", "sgd", steps=STEPS)
    gap = max((bf16["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert gap > 1e-4   # float8 really ran: it trains apart from bf16
    blocks = [f"blocks.{i}.{m}" for i in range(2)
              for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")]
    for *results, zero3 in run_ranks(2, data_parallel_fp8, timeout=200):
        for result in results:   # DDP, ZeRO-1, ZeRO-3
            check_within_bf16_round_off(result, ref)
        assert zero3["float8"] == blocks   # ZeRO-3 gathers into torchao's own linears


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(mt.PlanError, match="precision='fp8' on the CPU: a CPU has no float8 "
                                           "matmuls; emulate them with fp8_emulate=True"):
        check_fp8("fp8", False, "cpu")
    with pytest.raises(mt.PlanError, match=r"precision='fp8' on NVIDIA A100 \(compute "
                                           r"capability 8.0\): float8 matmuls need 8.9"):
        check_fp8("fp8", False, "cuda", (8, 0), "NVIDIA A100")
    check_fp8("fp8", False, "cuda", (9, 0), "NVIDIA H100")   # Hopper runs it
    with pytest.raises(mt.PlanError, match="precision='fp8' with tp=2, pp=1, compile=False"):
        from meshtrain.core.admit import check_plan
        check_plan(mt.Plan(tp=2, **FP8))
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
