"""Sequence parallel as Megatron-LM runs it: the column-parallel layers keep their input's
sequence slice and gather it again in backward (strategies/tensor_parallel/sequence.py).

On tp = 2 ranks: the bytes autograd keeps for one transformer layer, and for a whole step,
equal the planner's (Korthikanti et al. 2022, Table 2: 34/t per s b h in 16-bit, here fp32
with the GPT's fused attention and no dropout: 4e/t + 24e/(2t) = 16 s b h e / t), with and
without recomputation; and training with recomputation still reproduces one process."""
import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner.activations import layer_activation_bytes
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

CONFIG = GPTConfig(vocab_size=256, seq_len=128, n_layer=3, n_head=4, d_model=256)
B = 4
MODES = ("none", "selective", "full")


def kept_bytes() -> dict:
    """This rank's measured bytes, per recompute mode: one layer's (its input split along
    the sequence, as the layer before hands it over) and one whole step's."""
    tp, out = dist.get_world_size(), {}
    for mode in MODES:
        torch.manual_seed(0)
        trainer = mt.Trainer(GPT(CONFIG), mt.Plan(tp=tp, sequence_parallel=True, recompute=mode,
                                                  measure_activations=True), optimizer=eq.sgd)
        meter, model = trainer.activations, trainer.model
        x = torch.randn(B, CONFIG.seq_len // tp, CONFIG.d_model, requires_grad=True)
        with meter.measure():
            y = model.blocks[0](x)
        layer = meter.last_bytes
        y.sum().backward()   # the regathers run, so every rank's collectives pair up
        batch = torch.randint(0, CONFIG.vocab_size, (2, B, CONFIG.seq_len))
        trainer.step(batch[0], batch[1])
        out[mode] = {"layer": layer, "step": trainer.activations.last_bytes}
        trainer.close()
    return out


def test_kept_activations_are_korthikantis_34_over_t():
    from meshtrain.measure.verify import plan_inputs
    from meshtrain.planner.memory import memory

    spec, tp, s, h = from_gpt_config(CONFIG), 2, CONFIG.seq_len, CONFIG.d_model
    for rank, kept in enumerate(run_ranks(tp, kept_bytes, timeout=120)):
        for mode in MODES:
            layer = layer_activation_bytes(spec, s, B, tp=tp, sp=True, recompute=mode,
                                           elem_bytes=4)
            assert kept[mode]["layer"] == pytest.approx(layer, rel=0.02), (rank, mode)
            plan = {"tp": tp, "sequence_parallel": True, "recompute": mode}
            whole = memory(*plan_inputs(plan, B, vars(CONFIG))).activations
            assert kept[mode]["step"] == pytest.approx(whole, rel=0.02), (rank, mode)
        # no recomputation: 16 s b h fp32 elements / t per layer; the gathered attention and
        # MLP inputs kept whole would be 2 s b h (1 - 1/t) elements more (9 s b h, not 8)
        sbh_bytes = s * B * h * 4
        assert kept["none"]["layer"] == pytest.approx(16 / tp * sbh_bytes, rel=0.02)
        assert kept["none"]["layer"] < 0.95 * (16 / tp + 2 * (1 - 1 / tp)) * sbh_bytes


# per-op selective without sequence parallel too: its all-reduce of a kept matmul output
RECOMPUTED = (("full", True), ("selective", True), ("selective", False), ("attention", True))


def train_recomputed() -> list[dict]:
    return [eq.train(mt.Plan(tp=dist.get_world_size(), sequence_parallel=sp, microbatches=2,
                             recompute=mode), "gpt_tp", "sgd", max_grad_norm=0.2)
            for mode, sp in RECOMPUTED]


def test_recomputation_under_sequence_parallel_matches_one_process():
    ref = eq.reference("gpt_tp", "sgd", max_grad_norm=0.2)
    for rank, results in enumerate(run_ranks(2, train_recomputed, timeout=120)):
        for result, (mode, sp) in zip(results, RECOMPUTED):
            eq.assert_equivalent(result, ref, what=f"tp=2 sp={sp} recompute={mode} rank {rank}")
