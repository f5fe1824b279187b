"""A checkpoint is written in even shares ([Note: even shares] in train/checkpoint_shares.py):
every rank of a stage writes its rows of each tensor, within a stated bound of the stage's
bytes / n, kept in host memory in their own storages; the save's memory peak stays under
training's plus the share; and what one plan saves another loads exactly."""
import pytest
import torch

import meshtrain as mt
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.testing import run_ranks
from meshtrain.train import checkpoint_shares
from meshtrain.train.checkpoint_shares import WHOLE_BELOW

# the embedding and the vocabulary projection (16384 x 32 each, 6 MiB with AdamW's two
# moments) are 99% of the state: given whole, two ranks would write nearly all of it
CONFIG = GPTConfig(vocab_size=16384, seq_len=16, n_layer=1, n_head=2, d_model=32, bias=False)
PLANS = {"zero3": {"dp": 4, "zero": 3}, "tp-zero1": {"dp": 2, "tp": 2, "zero": 1}}
FP32, STATES = 4, 3   # the parameter, exp_avg and exp_avg_sq; and a 4-byte step counter


def trained(plan: mt.Plan, seed: int, config: GPTConfig = CONFIG) -> mt.Trainer:
    torch.manual_seed(seed)
    trainer = mt.Trainer(GPT(config), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=g)
    mine = tokens.chunk(trainer.dp_size)[trainer.dp_rank]
    trainer.step(mine[:, :-1], mine[:, 1:])
    return trainer


def save_and_cross_load(path: str) -> dict:
    out, savers = {}, {}
    for kind, plan_kw in PLANS.items():
        saver = savers[kind] = trained(mt.Plan(**plan_kw), seed=0)
        saver.save(f"{path}/warm-up")   # a process's first save also starts DCP's machinery
        saver.checkpoint_peak = 0
        saver.save(f"{path}/{kind}")
        share = checkpoint_shares.share_of_state(saver)   # what the save wrote
        kept = [*share.model_state.values(), *(v for s in share.states.values()
                                               for v in s.values())]
        out[kind] = {"share": saver.checkpoint_share, "bound": share.bound(),
                     "train_peak": saver.train_peak,
                     "checkpoint_peak": saver.checkpoint_peak,
                     "devices": sorted({t.device.type for t in kept}),
                     "own_storage": share.bytes() == sum(t.numel() * t.element_size()
                                                        for t in kept)}
    for saved, loader in (("zero3", "tp-zero1"), ("tp-zero1", "zero3")):
        fresh = trained(mt.Plan(**PLANS[loader]), seed=1)   # other values, overwritten
        fresh.load(f"{path}/{saved}")
        out[saved]["differ"] = differ(savers[saved], fresh)
    return out


def differ(want: mt.Trainer, got: mt.Trainer) -> list[str]:
    """The entries of the consolidated state (parameters, optimizer states) that differ."""
    a, b = want.full_state_dict(), got.full_state_dict()
    a_opt, b_opt = (t.full_optimizer_state()["state"] for t in (want, got))
    return ([k for k in a if not torch.equal(a[k], b[k])]
            + [f"{n}.{k}" for n, s in a_opt.items() for k, v in s.items()
               if not torch.equal(v, b_opt[n][k])])


def theory(ranks: int) -> tuple[int, int, int]:
    """(the state's bytes, how far a rank's share may be from bytes / ranks with the step
    counters aside, the largest parameter's bytes with its states), from the model's shapes
    and the stated rule."""
    params = list(GPT(CONFIG).parameters())
    total = sum(p.numel() * FP32 * STATES + FP32 for p in params)
    whole = [p.numel() * FP32 * STATES for p in params
             if p.numel() * FP32 * STATES < WHOLE_BELOW or p.shape[0] < ranks]
    rows = [p.numel() // p.shape[0] * FP32 * STATES for p in params
            if p.numel() * FP32 * STATES >= WHOLE_BELOW and p.shape[0] >= ranks]
    # the largest whole tensor and a row of each cut one
    return total, max(whole) + sum(rows), max(p.numel() * FP32 * STATES for p in params)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return run_ranks(4, save_and_cross_load, str(tmp_path_factory.mktemp("shares")), timeout=120)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_every_rank_writes_an_even_share_of_the_state(saved, kind):
    total, bound, largest = theory(len(saved))
    shares = [result[kind]["share"] for result in saved]
    assert sum(shares) == total, (kind, shares, total)   # each element written once
    counters = len(list(GPT(CONFIG).parameters())) * FP32   # 0-dim, with the first rows
    for rank, result in enumerate(saved):
        # the bound the code states: the theory's where every tensor is whole over the
        # ranks; tp slices have smaller parts and rows no longer
        stated = result[kind]["bound"]
        assert stated == bound if kind == "zero3" else 0 < stated <= bound, (kind, rank, stated)
        assert abs(shares[rank] - total / len(saved)) <= stated + counters, (kind, rank, shares)
    # the bound is far below the largest tensor, which one rank would write whole
    assert max(shares) < largest < total / len(saved) + largest


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_a_share_is_kept_in_host_memory_in_its_own_storage(saved, kind):
    for result in saved:
        assert result[kind]["devices"] == ["cpu"]
        assert result[kind]["own_storage"], kind   # no kept rows hold a whole tensor alive


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_the_save_peaks_no_higher_than_training_and_its_share(saved, kind):
    """ZeRO moves each rank its rows (no unit or bucket gathered, nothing gathered over
    tp): the save holds the share (and a bucket's rows in transit) over what the rank
    holds between steps, which training's gathered units, gradient buckets and
    activations exceed."""
    for rank, result in enumerate(saved):
        got = result[kind]
        assert got["checkpoint_peak"] <= got["train_peak"] + got["share"], (kind, rank, got)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_a_checkpoint_in_shares_loads_exactly_under_the_other_plan(saved, kind):
    for rank, result in enumerate(saved):
        assert not result[kind]["differ"], (kind, rank, result[kind]["differ"][:5])


# ---- expert parallel: each rank writes rows of its own experts, none gathered whole -------
# the packed experts are 85% of the state (2 x 4 experts, 9.4 MB with AdamW's moments)
MOE = GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=128, bias=False,
                experts=4)
EP_PLANS = {"ep-zero3": {"dp": 4, "ep": 2, "zero": 3}, "ep-ddp": {"dp": 4, "ep": 2},
            "ep-tp-zero1": {"dp": 2, "tp": 2, "ep": 2, "zero": 1}}
DENSE = {"dp": 4, "zero": 1}   # no ep: loads the ep checkpoints, and saves one for them
EXPERTS = ("blocks.0.mlp.experts.gate_up_proj", "blocks.0.mlp.experts.down_proj")


def save_ep_and_cross_load(path: str) -> dict:
    out, savers = {}, {}
    for kind, plan_kw in EP_PLANS.items():
        saver = savers[kind] = trained(mt.Plan(**plan_kw), seed=0, config=MOE)
        saver.save(f"{path}/warm-up")
        saver.checkpoint_peak = 0
        gathers = saver.comm.stats.total(op="all_gather").received
        saver.save(f"{path}/{kind}")
        gathers = saver.comm.stats.total(op="all_gather").received - gathers
        share = checkpoint_shares.share_of_state(saver)
        out[kind] = {"share": saver.checkpoint_share, "bound": share.bound(), "gathers": gathers,
                     "train_peak": saver.train_peak, "checkpoint_peak": saver.checkpoint_peak,
                     "experts": {k: (tuple(share.model_state[k].shape),
                                     tuple(share.states[k]["exp_avg"].shape),
                                     share.placed[("model", k)])
                                 for k in EXPERTS if k in share.model_state}}
    dense = trained(mt.Plan(**DENSE), seed=1, config=MOE)   # other values, overwritten
    dense.load(f"{path}/ep-zero3")
    out["ep-zero3"]["differ"] = differ(savers["ep-zero3"], dense)
    dense.save(f"{path}/dense")   # and the reverse: a checkpoint without ep, loaded under it
    for kind in ("ep-ddp", "ep-tp-zero1"):
        savers[kind].load(f"{path}/dense")
        out[kind]["differ"] = differ(dense, savers[kind])
    return out


def expert_written(plan_kw: dict, rank: int) -> int:
    """The one expert `rank` writes of each packed tensor (4 experts): of its ep rank's
    2, the one at its place among the ranks holding them (edp rank x tp + tp rank)."""
    tp, ep = plan_kw.get("tp", 1), plan_kw["ep"]
    dp_rank, tp_rank = divmod(rank, tp)
    return dp_rank % ep * (MOE.experts // ep) + dp_rank // ep * tp + tp_rank


@pytest.fixture(scope="module")
def ep_saved(tmp_path_factory):
    return run_ranks(4, save_ep_and_cross_load, str(tmp_path_factory.mktemp("ep-shares")),
                     timeout=120)


@pytest.mark.parametrize("kind", sorted(EP_PLANS))
def test_under_ep_every_rank_writes_rows_of_its_own_experts(ep_saved, kind):
    params = dict(GPT(MOE).named_parameters())
    total = sum(p.numel() * FP32 * STATES + FP32 for p in params.values())
    shares = [result[kind]["share"] for result in ep_saved]
    assert sum(shares) == total, (kind, shares, total)   # each element written once
    for rank, result in enumerate(ep_saved):
        got = result[kind]
        assert abs(got["share"] - total / 4) <= got["bound"] + len(params) * FP32, (rank, got)
        # one expert of its ep rank's, at its offset in the whole tensor: none gathered whole
        assert sorted(got["experts"]) == sorted(EXPERTS), (kind, rank)
        for key, (shape, state_shape, (whole_shape, boxes)) in got["experts"].items():
            assert whole_shape == tuple(params[key].shape)
            assert shape == state_shape == (1, *whole_shape[1:]), (kind, rank, key, shape)
            offsets = {b.offsets for b in boxes}
            expert = expert_written(EP_PLANS[kind], rank)
            assert offsets == {(expert, 0, 0)}, (kind, rank, offsets)
        assert got["gathers"] == 0, (kind, rank, got["gathers"])   # over ep, nor over dp
        assert got["checkpoint_peak"] <= got["train_peak"] + got["share"], (kind, rank, got)


@pytest.mark.parametrize("kind", sorted(EP_PLANS))
def test_an_ep_checkpoint_loads_exactly_without_ep_and_the_reverse(ep_saved, kind):
    for rank, result in enumerate(ep_saved):
        assert not result[kind]["differ"], (kind, rank, result[kind]["differ"][:5])
