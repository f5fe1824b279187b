"""Tensor parallel against theory, from the counters and the tensors themselves: the
collectives of one step (Megatron 2021: 2 all-reduces of b·s·h forward and 2 backward per
block; sequence parallel the same bytes as reduce-scatters and all-gathers, and one more
all-gather per region in backward that rebuilds the input its column layers saved as a
slice), the LayerNorm
regions' activation bytes divided by T under sequence parallel, and checkpoints that move
between one process and a tp plan both ways."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshtrain as mt
from meshtrain.core.comm import ring_all_reduce_elements, ring_half_elements
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

CFG = eq.TP_CONFIG
MICRO = 2
B, S, H = eq.GLOBAL_BATCH // MICRO, CFG.seq_len, CFG.d_model   # one micro-batch
F32 = 4


def one_step_counters(sequence_parallel: bool) -> dict:
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt_tp(), mt.Plan(tp=dist.get_world_size(), microbatches=MICRO,
                                              sequence_parallel=sequence_parallel),
                         optimizer=eq.sgd)
    x, y = eq.batches("gpt_tp", 1)[0]
    trainer.comm.stats.reset()
    trainer.step(x, y)
    partial = sum(p.numel() for n, p in trainer.model.named_parameters()
                  if n in trainer.sharding.partial)
    return {"counters": {(a, o, t): (c.calls, c.sent, c.received)
                         for (a, o, t), c in trainer.comm.stats.counters.items()},
            "partial_numel": partial}


def expected(tp: int, rank: int, sp: bool, partial_numel: int) -> dict:
    """(axis, op, tag) -> (calls, bytes sent, bytes received) of one step, from theory."""
    out: dict = {}

    def add(op, tag, elements, half):
        sent = F32 * (ring_half_elements(elements, tp, rank) if half
                      else ring_all_reduce_elements(elements, tp, rank))
        calls, s, r = out.get(("tp", op, tag), (0, 0, 0))
        out[("tp", op, tag)] = (calls + 1, s + sent, r + sent)

    bsh = B * S * H
    for _ in range(MICRO):
        for i in range(CFG.n_layer):
            for region in (f"blocks.{i}.attn", f"blocks.{i}.mlp"):
                if sp:   # enter: all-gather / reduce-scatter; exit: reduce-scatter / all-gather
                    add("all_gather", f"{region}:forward", bsh, True)
                    add("reduce_scatter", f"{region}:forward", bsh, True)
                    add("reduce_scatter", f"{region}:backward", bsh, True)
                    add("all_gather", f"{region}:backward", bsh, True)
                    add("all_gather", f"{region}:regather", bsh, True)   # q, k, v share one
                else:
                    add("all_reduce", f"{region}:forward", bsh, False)
                    add("all_reduce", f"{region}:backward", bsh, False)
        add("all_reduce", "embed.tok:forward", bsh, False)           # vocab-parallel lookup
        if sp:
            add("all_gather", "embed:backward", bsh, True)           # the split's adjoint
            add("all_gather", "head.lm_head:forward", bsh, True)
            add("reduce_scatter", "head.lm_head:backward", bsh, True)
            add("all_gather", "head.lm_head:regather", bsh, True)
        else:
            add("all_reduce", "head.lm_head:backward", bsh, False)
        add("all_reduce", "loss:forward", B * S, False)              # the row maxima
        add("all_reduce", "loss:forward", 2 * B * S, False)          # sum of exp, target logit
    if sp:
        add("all_reduce", "partial-grads", partial_numel, False)     # once per step
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_per_block_equal_theory(world):
    plain = run_ranks(world, one_step_counters, False)
    seq = run_ranks(world, one_step_counters, True)
    for rank in range(world):
        for sp, result in ((False, plain[rank]), (True, seq[rank])):
            assert result["counters"] == expected(world, rank, sp, result["partial_numel"]), \
                (world, rank, sp)
        # per block, sequence parallel moves exactly the bytes of the all-reduces it replaces
        for region in ("blocks.0.attn", "blocks.1.mlp"):
            for direction in ("forward", "backward"):
                tag = f"{region}:{direction}"
                total = lambda r: sum(v[1] for k, v in r["counters"].items() if k[2] == tag)
                assert total(seq[rank]) == total(plain[rank]) > 0


def layer_norm_activation_bytes(sequence_parallel: bool) -> int:
    """Bytes autograd saves inside the GPT's LayerNorms during one forward (parameters out)."""
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt_tp(), mt.Plan(tp=dist.get_world_size(),
                                              sequence_parallel=sequence_parallel),
                         optimizer=eq.sgd)
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    inside, saved = [False], {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    for m in trainer.model.modules():
        if isinstance(m, nn.LayerNorm):
            m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            m.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    x, y = eq.batches("gpt_tp", 1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.loss_fn(trainer.model(x), y)
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_divides_layer_norm_activations_by_tp(world):
    plain = run_ranks(world, layer_norm_activation_bytes, False)
    seq = run_ranks(world, layer_norm_activation_bytes, True)
    # each LayerNorm keeps its input (b, s, h) and its mean and 1/std (b, s, 1), fp32
    layer_norms = 2 * CFG.n_layer + 1
    whole = layer_norms * F32 * eq.GLOBAL_BATCH * S * (H + 2)
    assert plain == [whole] * world
    assert seq == [whole // world] * world


def resume_under_tp(one_process_ckpt: str, out: str) -> dict:
    torch.manual_seed(1)   # other weights: everything must come from the checkpoint
    trainer = mt.Trainer(eq.gpt_tp(), mt.Plan(tp=dist.get_world_size(), sequence_parallel=True),
                         optimizer=eq.adamw)
    trainer.load(one_process_ckpt)
    loaded = trainer.full_state_dict(), copy.deepcopy(trainer.full_optimizer_state())
    for x, y in eq.batches("gpt_tp", 4)[2:]:
        trainer.step(x, y)
    trainer.save(out)
    return {"loaded": loaded, "final": (trainer.full_state_dict(),
                                        trainer.full_optimizer_state())}


def assert_same_state(a, b, what):
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        torch.testing.assert_close(model_a[name], model_b[name], rtol=0, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")
    assert optim_a["state"].keys() == optim_b["state"].keys()
    for name, states in optim_a["state"].items():
        for key, value in states.items():
            torch.testing.assert_close(optim_b["state"][name][key], value, rtol=0, atol=1e-6)


def test_checkpoints_move_between_one_process_and_tensor_parallel(tmp_path):
    one, tp_ckpt = str(tmp_path / "one"), str(tmp_path / "tp")
    torch.manual_seed(0)
    single = mt.Trainer(eq.gpt_tp(), mt.Plan(), optimizer=eq.adamw)
    for x, y in eq.batches("gpt_tp", 2):
        single.step(x, y)
    single.save(one)
    saved = single.full_state_dict(), copy.deepcopy(single.full_optimizer_state())
    ranks = run_ranks(2, resume_under_tp, one, tp_ckpt)
    for rank, result in enumerate(ranks):
        assert_same_state(saved, result["loaded"], f"one process -> tp rank {rank}")
    # the tp run's checkpoint loads into one process, which continues as one process would
    back = mt.Trainer(eq.gpt_tp(), mt.Plan(), optimizer=eq.adamw)
    back.load(tp_ckpt)
    assert_same_state(ranks[0]["final"], (back.full_state_dict(), back.full_optimizer_state()),
                      "tp -> one process")
    for x, y in eq.batches("gpt_tp", 4)[2:]:
        single.step(x, y)
    assert_same_state((single.full_state_dict(), single.full_optimizer_state()),
                      (back.full_state_dict(), back.full_optimizer_state()),
                      "tp run vs one-process run")


def _llama_tp_sent(model) -> dict:
    from meshtrain.measure.verify import verify_rank
    return verify_rank(model, {"tp": dist.get_world_size()}, 2, steps=1, warmup=1)["sent"]


def test_a_transformers_llamas_q_k_v_and_gate_up_enter_tensor_parallel_once():
    """Its q, k and v projections (and gate and up) are separate column layers reading one
    input: they enter the region once, their input gradients summed before one all-reduce
    (Megatron's count: 2 all-reduces forward and 2 backward per block), so the bytes tensor
    parallel sends are the planner's for the model's config, as for meshtrain's GPT."""
    from meshtrain.measure.trained_model import TrainedModel
    from meshtrain.measure.verify import predict_sent

    pytest.importorskip("transformers")
    model = TrainedModel("llama-tiny", 32)
    sent = run_ranks(2, _llama_tp_sent, model, timeout=120)
    predicted = predict_sent({"tp": 2}, 2, model)["tp"]
    for rank in sent:
        assert rank["tp"] == pytest.approx(predicted, rel=0.01)
