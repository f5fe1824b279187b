"""Tensor parallel without processes: the splits, each rank's slice of every layer (a rank's
view of a tp mesh needs no process group to shard, only to communicate), what `print`
shows, and every refusal with its message."""
import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.core.comm import Comm
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import PlanError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.strategies import tensor_parallel
from meshtrain.strategies.tensor_parallel.gpt import shard_gpt
from meshtrain.strategies.tensor_parallel.sharding import Split
from meshtrain.strategies.tensor_parallel.tp_plan import shard_with_plan

CONFIG = GPTConfig(vocab_size=62, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=True)


def rank_comm(rank: int, tp: int) -> Comm:
    """Rank `rank`'s Comm on a (1, 1, tp) mesh, with no process group behind it."""
    mesh = Mesh(shape={"pp": 1, "dp": 1, "cp": 1, "tp": tp},
                coords={"pp": 0, "dp": 0, "cp": 0, "tp": rank},
                rank=rank, device=torch.device("cpu"))
    return Comm(mesh)


def sharded_gpts(tp: int, sequence_parallel: bool = False):
    whole = GPT(CONFIG)
    shards = []
    for rank in range(tp):
        model = GPT(CONFIG)
        model.load_state_dict(whole.state_dict())
        shards.append((model, shard_gpt(model, rank_comm(rank, tp), sequence_parallel)))
    return whole, shards


@pytest.mark.parametrize("split, shape", [
    (Split(0, 62, 64), (62, 32)),            # a vocabulary, padded for tp = 4
    (Split(1, 96, 96, blocks=3), (32, 96)),  # a fused q, k, v Conv1D (in, out)
    (Split(1, 128, 128), (32, 128)),         # nn.Linear split by input features
])
def test_slices_reassemble_to_the_whole(split, shape):
    whole = torch.randn(shape)
    slices = [split.local(whole, r, 4) for r in range(4)]
    assert all(s.shape[split.dim] == split.padded // 4 for s in slices)
    torch.testing.assert_close(split.assemble(torch.stack(slices)), whole, rtol=0, atol=0)


def test_fused_qkv_slice_holds_the_same_heads_of_q_k_and_v():
    q, k, v = (torch.full((2, 8), float(i)) for i in range(3))
    fused = torch.cat([q, k, v], dim=1)                      # Conv1D (in=2, out=3*8)
    first = Split(1, 24, 24, blocks=3).local(fused, 0, 2)   # rank 0 of 2: 4 of each
    assert first[0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4


@pytest.mark.parametrize("tp", [2, 4])
def test_every_split_weight_holds_exactly_one_tp_th(tp):
    whole, shards = sharded_gpts(tp)
    full = dict(whole.named_parameters())
    for model, sharding in shards:
        local = dict(model.named_parameters())
        assert set(local) == set(full)                       # the names are kept
        for name, split in sharding.splits.items():
            padded = list(full[name].shape)
            padded[split.dim] = split.padded
            assert local[name].numel() * tp == torch.Size(padded).numel(), name
        replicated = set(full) - set(sharding.splits)
        assert all(local[n].shape == full[n].shape for n in replicated)
        assert all(".ln" in n or "proj.bias" in n or n == "embed.pos.weight"
                   for n in replicated)
    # the slices of every rank put together are the whole weights
    for name, split in shards[0][1].splits.items():
        gathered = torch.stack([dict(m.named_parameters())[name].detach() for m, _ in shards])
        torch.testing.assert_close(split.assemble(gathered), full[name].detach(), rtol=0, atol=0)


def test_print_shows_the_sharding():
    _, shards = sharded_gpts(2, sequence_parallel=True)
    text = str(shards[1][0])
    assert "heads=2/4" in text
    assert "in_features=32, out_features=16 of 32 (tp rank 1/2)" in text            # q
    assert "in_features=64 of 128, out_features=32 (tp rank 1/2)" in text           # mlp.proj
    assert "rows 31..61 of 62 (+0 padding)" not in text and "rows 31..61 of 62" in text
    assert "out_features=31 of 62 (tp rank 1/2)" in text                           # lm_head
    assert "reduce_scatter_to_sequence(dim=1)" in text


def test_partial_gradients_are_the_sequence_regions_parameters():
    _, shards = sharded_gpts(2, sequence_parallel=True)
    partial = shards[0][1].partial
    assert "head.ln_f.weight" in partial and "blocks.1.ln2.bias" in partial
    assert "blocks.0.attn.proj.bias" in partial and "blocks.0.mlp.proj.bias" in partial
    assert not any("q." in n or "fc." in n or "embed" in n for n in partial)
    _, plain = sharded_gpts(2)
    assert plain[0][1].partial == set()


def test_counts_replicated_parameters_on_one_tp_rank():
    _, shards = sharded_gpts(2)
    (_, first), (_, second) = shards
    assert first.counts("head.ln_f.weight") and not second.counts("head.ln_f.weight")
    assert first.counts("blocks.0.mlp.fc.weight") and second.counts("blocks.0.mlp.fc.weight")


# ---- refusals --------------------------------------------------------------------------------
def test_sequence_parallel_needs_tp():
    with pytest.raises(PlanError, match=r"sequence_parallel=True .* needs tp > 1 \(got tp=1\); "
                                        r"set tp=2 or more"):
        mt.Plan(sequence_parallel=True)
    with pytest.raises(PlanError, match="must be True or False"):
        mt.Plan(tp=2, sequence_parallel="yes")


def test_heads_tp_does_not_divide_are_refused_before_any_process_group():
    with pytest.raises(PlanError, match=r"tp=4 does not divide the GPT's n_head=2 attention "
                                        r"heads.*choose tp among \[1, 2\]"):
        tensor_parallel.check(GPT(GPTConfig(n_head=2, d_model=32, n_layer=1)), mt.Plan(tp=4),
                              None)
    with pytest.raises(PlanError, match="does not divide the GPT's n_head=4"):
        mt.Trainer(GPT(CONFIG), mt.Plan(tp=3), optimizer=torch.optim.SGD)   # no mesh yet


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 8))


@pytest.mark.parametrize("tp_plan, message", [
    ({"1": "column", "3": "row"}, r"tp=4 does not divide 1's out_features=6 \('column'"),
    ({"3": "row"}, r"tp=4 does not divide 3's in_features=6 \('row'"),
    ({"mlp.*": "column"}, r"pattern 'mlp.\*' matches no module of Sequential; shardable "
                          r"modules are named like: 0, 1, 3"),
    ({"2": "column"}, r"matches 2, a GELU: only nn.Linear, transformers' Conv1D and "
                      r"nn.Embedding can be sharded"),
    ({"0": "column"}, r"0 is an nn.Embedding, sharded only as 'vocab'"),
    ({"1": "diagonal"}, r"tp_plan\['1'\] = 'diagonal': choose one of 'column', 'row'"),
    ({"*": "column", "1": "row"}, r"1 is matched by tp_plan patterns"),
    ({}, r"must be a non-empty dict"),
])
def test_bad_tp_plans_name_the_module_and_the_sizes(tp_plan, message):
    with pytest.raises(PlanError, match=message):
        tensor_parallel.check(mlp(), mt.Plan(tp=4), tp_plan)


def test_other_models_need_a_tp_plan_and_sequence_parallel_needs_the_gpt():
    with pytest.raises(PlanError, match="for a Sequential pass tp_plan="):
        tensor_parallel.check(mlp(), mt.Plan(tp=2), None)
    with pytest.raises(PlanError, match="sequence_parallel=True is built for meshtrain's GPT"):
        tensor_parallel.check(mlp(), mt.Plan(tp=2, sequence_parallel=True), {"1": "column"})


def test_a_tied_weight_must_be_sharded_wherever_it_is_used():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(PlanError, match=r"1.weight is the same tensor as 0.weight \(tied "
                                        r"weights\), which was sharded, but its module is not"):
        shard_with_plan(model, rank_comm(0, 2), {"0": "vocab"})
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    sharding = shard_with_plan(model, rank_comm(1, 2), {"0": "vocab", "1": "vocab"})
    assert model[0].weight is model[1].weight and model[0].weight.shape == (5, 8)
    assert sharding.vocab_start == 5 and sharding.vocab == 10


def test_tp_plan_with_one_rank_is_refused():
    with pytest.raises(PlanError, match="tp_plan is given but Plan.tp=1"):
        mt.Trainer(mlp(), mt.Plan(tp_plan={"1": "column"}), optimizer=torch.optim.SGD,
                   loss_fn=nn.MSELoss())


@pytest.mark.parametrize("conv1d", [False, True])
def test_a_linear_on_the_gathered_sequence_has_the_linears_gradients(conv1d):
    """sequence.py's matmul (here over a tp group of one, whose gather is the identity)
    against autograd's, in nn.Linear's (out, in) layout and Conv1D's (in, out); what it
    saves for backward is the slice it is given, and its weight gradient reads the
    regathered input."""
    from meshtrain.strategies.tensor_parallel.layers import _matmul
    from meshtrain.strategies.tensor_parallel.sequence import Regather, linear_on_gathered

    torch.manual_seed(0)
    x = torch.randn(2, 6, 5, requires_grad=True)
    w = torch.randn(5, 7) if conv1d else torch.randn(7, 5)
    w.requires_grad_()
    b = torch.randn(7, requires_grad=True)
    g = torch.randn(2, 6, 7)
    grads = torch.autograd.grad(_matmul(x, w, b, conv1d), (x, w, b), g)
    regather = Regather(rank_comm(0, 1), dim=1, tag="t")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_on_gathered(x, x.detach(), regather, w, b, conv1d)
    assert [s.data_ptr() for s in saved] == [x.data_ptr(), w.data_ptr()]
    torch.testing.assert_close(y, _matmul(x, w, b, conv1d))
    for got, want in zip(torch.autograd.grad(y, (x, w, b), g), grads):
        torch.testing.assert_close(got, want)
    assert regather.readers == 0
