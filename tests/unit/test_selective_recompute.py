"""Per-op selective recomputation (PyTorch's selective checkpoint API) and every k-th layer
fully recomputed: what a step keeps, measured by the Trainer's ActivationMeter, against the
planner's price; what "selective" keeps is exactly the outputs of its stated ops."""
from __future__ import annotations

import pytest
import torch

import meshtrain as mt
from meshtrain.core.memory import ActivationMeter
from meshtrain.measure.trained_model import TrainedModel
from meshtrain.measure.verify import plan_inputs
from meshtrain.models import registry
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner.activations import layer_activation_bytes
from meshtrain.planner.memory import memory
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.strategies.recompute import SAVED_OPS, apply_recompute

CONFIG = GPTConfig(vocab_size=256, seq_len=64, n_layer=3, n_head=4, d_model=128)


def test_a_gpt_layer_keeps_its_matmul_and_attention_outputs():
    """Measured on one block: its input and the outputs of its six matmuls and its attention
    kernel, 11 s b h fp32 elements (+ the log-sum-exp, a floats per token); predicted by the
    planner's per-op formula. "none" keeps 16 s b h: selective keeps less."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    meter = ActivationMeter(model.parameters())
    assert apply_recompute(model, "selective", meter.keep) == ["embed", "blocks.0", "blocks.1",
                                                               "blocks.2"]
    b, s, h = 2, CONFIG.seq_len, CONFIG.d_model
    x = model.embed(torch.randint(0, CONFIG.vocab_size, (b, s))).detach().requires_grad_()
    with meter.measure():
        model.blocks[0](x).sum().backward()
    spec = from_gpt_config(CONFIG, "gpt")
    predicted = layer_activation_bytes(spec, s, b, recompute="selective", elem_bytes=4)
    assert meter.last_bytes == predicted == (11 * h + CONFIG.n_head) * s * b * 4
    assert predicted < layer_activation_bytes(spec, s, b, recompute="none", elem_bytes=4)


def test_a_mixtures_layer_keeps_its_router_logits_and_each_routed_rows_matmuls():
    """gpt-moe-tiny's block (4 experts, top 2, SwiGLU 512 wide) under "selective", measured:
    beside attention's as a GPT's, the router's logits (E) and per routed row its expert's
    gate-and-up (2 I) and down (h) outputs, in place of a dense MLP's 2 k I + h per token:
    E + (k - 1) h more elements a token; the planner's per-op formula prices exactly that."""
    from meshtrain.core.gpt_shapes import GPT_SHAPES
    from meshtrain.planner import experts

    config = GPTConfig(**{**GPT_SHAPES["gpt-moe-tiny"], "seq_len": 64})
    torch.manual_seed(0)
    model = GPT(config)
    meter = ActivationMeter(model.parameters())
    apply_recompute(model, "selective", meter.keep)
    b, s, h = 2, config.seq_len, config.d_model
    x = torch.randn(b, s, h, requires_grad=True)
    with meter.measure():
        model.blocks[0](x).sum().backward()
    spec = from_gpt_config(config, "gpt")
    i, e, k = spec.expert_width, spec.experts, spec.top_k
    routed = e + k * (2 * i + h)
    assert experts.selective_bytes_per_token(spec, k, 4) == 4 * routed
    predicted = layer_activation_bytes(spec, s, b, recompute="selective", elem_bytes=4)
    # input, Q K V, attention output and its log-sum-exp, output projection: 6 h + a
    assert meter.last_bytes == predicted == (6 * h + config.n_head + routed) * s * b * 4
    # expert parallel with a capacity of half the choices keeps half the rows
    half = layer_activation_bytes(spec, s, b, recompute="selective", elem_bytes=4, routed=1)
    assert predicted - half == (2 * i + h) * s * b * 4


def test_only_the_stated_ops_are_kept():
    """The policy's kept tensors are outputs of SAVED_OPS and nothing else: a layer's norms,
    activations and residual adds run again in backward, with the same gradients."""
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    plain, model = GPT(CONFIG), GPT(CONFIG)
    model.load_state_dict(plain.state_dict())
    apply_recompute(model, "selective")
    x = torch.randn(2, CONFIG.seq_len, CONFIG.d_model)
    plain.blocks[0](x).square().sum().backward()
    with Ops():
        model.blocks[0](x).square().sum().backward()
    assert {op for op in seen if op in SAVED_OPS}   # the block ran kept ops ...
    assert seen.count(torch.ops.aten.gelu.default) == 2   # ... and its GELU twice
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)


SEQ, BATCH = 32, 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute,every", [("selective", 1), ("full", 2)])
def test_a_llama_step_keeps_what_the_planner_prices(recompute, every, precision):
    """A transformers Llama's whole step (every layer, the head, the loss), measured, within
    2% of the planner (what is left: RoPE's tables, kept with each layer's inputs); the
    planner's "selective" keeps less than "none" and more than "full"."""
    pytest.importorskip("transformers")
    plan = {"precision": precision, "recompute": recompute, "recompute_every": every}
    torch.manual_seed(0)
    built = registry.build_model("llama-tiny", {}, SEQ)
    trainer = mt.Trainer(built.module, mt.Plan(**plan, measure_activations=True),
                         lambda params: torch.optim.SGD(params, lr=0.1), loss_fn=built.loss)
    tokens = torch.randint(0, registry.BYTE_VOCAB, (BATCH, SEQ + 1))
    trainer.step(tokens[:, :-1], tokens[:, 1:])
    assert trainer.recomputed == ["model.layers.0", "model.layers.1"][every - 1::every]
    inputs = plan_inputs(plan, BATCH, TrainedModel("llama-tiny", SEQ))
    predicted = memory(*inputs).activations
    assert trainer.memory_report().activations == pytest.approx(predicted, rel=0.02)
    spec, cand, setup = inputs
    per_layer = {mode: layer_activation_bytes(spec, SEQ, BATCH, recompute=mode,
                                              elem_bytes=setup.act_bytes)
                 for mode in ("none", "selective", "full")}
    assert per_layer["full"] < per_layer["selective"] < per_layer["none"]


def test_recompute_every_is_refused_where_it_cannot_apply():
    with pytest.raises(mt.PlanError, match="recompute_every=2 .* needs recompute='full' "
                                           r"\(got 'selective'\)"):
        mt.Plan(recompute="selective", recompute_every=2)
    with pytest.raises(mt.PlanError, match="recompute_every=0: must be a whole number >= 1"):
        mt.Plan(recompute="full", recompute_every=0)
    assert apply_recompute(GPT(CONFIG), "full", every=2) == ["blocks.1"]   # not the embedding
    with pytest.raises(mt.PlanError, match="recompute_every=4 is more than the 3 layers GPT "
                                           "recomputes"):
        apply_recompute(GPT(CONFIG), "full", every=4)


def test_an_op_writing_into_a_kept_output_is_not_run_again():
    """`y = x @ w; y += b` (as sequence parallel's linear adds its bias, and tensor
    parallel's all-reduce sums in place): the kept matmul output already holds the bias, so
    the add is kept too; run again in backward it would add the bias twice."""
    from torch.utils.checkpoint import checkpoint

    from meshtrain.strategies.recompute import _selective_contexts

    def layer(x, w, b):
        y = x @ w
        y += b
        return torch.tanh(y)

    torch.manual_seed(0)
    x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((8, 4), (4, 4), (4,)))
    layer(x, w, b).sum().backward()
    plain = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    checkpoint(layer, x, w, b, use_reentrant=False,
               context_fn=lambda: _selective_contexts(None)).sum().backward()
    for got, want in zip((x.grad, w.grad, b.grad), plain):
        torch.testing.assert_close(got, want)


def test_the_time_model_reruns_what_each_mode_recomputes():
    """Blocks a micro-batch runs (for elementwise work and dispatch): selective re-runs a
    block's forward but its matmuls (as full does, less the FLOPs), full with
    recompute_every=k one block in k."""
    from meshtrain.planner.compute_time import RECOMPUTED_BLOCK, blocks_run
    from meshtrain.planner.setup import Candidate

    spec = from_gpt_config(CONFIG, "gpt")   # 3 blocks
    run = {(mode, k): blocks_run(spec, Candidate(mt.Plan(recompute=mode, recompute_every=k),
                                                 1, mode))
           for mode, k in (("none", 1), ("selective", 1), ("full", 1), ("full", 3))}
    assert run["none", 1] == 3 and run["selective", 1] == run["full", 1] == 3 * RECOMPUTED_BLOCK
    assert run["full", 3] == pytest.approx(3 + (RECOMPUTED_BLOCK - 1))
