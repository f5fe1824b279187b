"""`plan --verify`'s own run (verify.verify_rank) of per-op selective recomputation and of
every k-th layer fully recomputed, on a small GPT and a small transformers Llama: the
activations it measures (the Trainer's ActivationMeter on a real step) within 5% of what the
planner prices (a transformers model: what its traced layer kept under the policy itself)."""
from __future__ import annotations

import pytest

from meshtrain.measure import verify
from meshtrain.measure.trained_model import TrainedModel, spec_of
from meshtrain.planner.memory import memory

GPT = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128)
LLAMA = TrainedModel("llama-tiny", 32)
# pairwise: each model under each mode, each precision under each mode
CASES = [(GPT, {"recompute": "selective", "precision": "fp32"}),
         (GPT, {"recompute": "full", "recompute_every": 2, "precision": "bf16"}),
         (LLAMA, {"recompute": "selective", "precision": "bf16"}),
         (LLAMA, {"recompute": "full", "recompute_every": 2, "precision": "fp32"})]


@pytest.mark.parametrize("model,plan", CASES,
                         ids=["gpt-selective-fp32", "gpt-every2-bf16", "llama-selective-bf16",
                              "llama-every2-fp32"])
def test_verify_measures_recomputation_as_the_planner_prices_it(model, plan):
    if isinstance(model, TrainedModel):
        pytest.importorskip("transformers")
    batch = 4
    measured = verify.verify_rank(model, plan, batch, steps=1, warmup=1, exact=False)
    predicted = memory(*verify.plan_inputs(plan, batch, model)).activations
    assert predicted == pytest.approx(measured["activations"], rel=0.05)


def test_a_transformers_llama_is_priced_from_what_its_traced_layer_kept():
    """The trace ran the selective policy on the model: a Llama layer keeps its input and
    the outputs of its seven matmuls and its fused attention, 5 h + 2 kv + 2 f elements and
    a fp32 log-sum-exp per head, per token, in either precision."""
    pytest.importorskip("transformers")
    spec = spec_of(LLAMA)
    h, kv, f, a = spec.hidden, spec.kv_dim, spec.ffn_hidden, spec.heads
    for elem in (4, 2):
        assert spec.traced_bytes_per_token(elem, selective=True) == (
            elem * (5 * h + 2 * kv + 2 * f) + 4 * a)
