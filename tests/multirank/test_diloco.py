"""DiLoCo and local SGD (issue 30): DDP in their special case, the bytes they send per H
steps, exact resume from a checkpoint, composition with tp and pp. (Bad plans:
tests/unit/test_data_parallel_plan.py.)"""
import pytest
import torch

import meshtrain as mt
from meshtrain.core.comm import ring_all_reduce_elements
from meshtrain.core.plan import PlanError
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

H = 2
K = 3   # warm-up steps
DILOCO = dict(dp_mode="diloco", sync_every=H, outer_lr=0.7, outer_momentum=0.9)


def _run(plan: mt.Plan, optimizer: str, steps: range, load=None, save=None) -> dict:
    """Train the eq GPT under `plan` on `steps` of the shared batches (from a checkpoint at
    `load`, saving to `save`); the losses, the state and this rank's dp bytes by tag."""
    torch.manual_seed(0)
    factory = eq.OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    trainer = mt.Trainer(eq.gpt(), plan, optimizer=factory)
    if load:
        trainer.load(load)
    trainer.comm.stats.reset()
    data = eq.batches("gpt", steps.stop, trainer.dp_rank, trainer.dp_size)
    losses = [trainer.step(*data[s]) for s in steps]
    traffic = {tag: trainer.comm.stats.total(axis="dp", tag=tag).sent
               for tag in ("grad", "loss", "pseudo-grad")}
    numel = sum(p.numel() for p in trainer.data_parallel.params)
    n_params = len(trainer.data_parallel.params)
    if save:
        trainer.save(save)
    return eq.on_host({"losses": losses, "state": trainer.full_state_dict(),
                       "optimizer": trainer.full_optimizer_state()["state"],
                       "traffic": traffic, "numel": numel, "n_params": n_params,
                       "dp_rank": trainer.dp_rank})


def nesterov(params):
    """What DiLoCo with H = 1, inner plain SGD (lr 0.5) and outer Nesterov SGD (lr 0.5,
    momentum 0.9) is: the outer step sees Δ = 0.5 g, so its buffer is 0.5 times this one's."""
    return torch.optim.SGD(params, lr=0.25, momentum=0.9, nesterov=True)


def world2_cases(folder: str) -> dict:
    dp2 = dict(dp=2)
    out = {"ddp": _run(mt.Plan(**dp2), "plain-sgd", range(6)),
           "local-sgd": _run(mt.Plan(**dp2, dp_mode="local-sgd"), "plain-sgd", range(6)),
           "diloco-1": _run(mt.Plan(**dp2, dp_mode="diloco", outer_lr=1.0, outer_momentum=0.0),
                            "plain-sgd", range(6)),
           "ddp-1step": _run(mt.Plan(**dp2), "adamw", range(1)),
           # H = 1, inner SGD lr a, outer Nesterov (lr b, m): DDP with Nesterov SGD (ab, m)
           "diloco-nesterov": _run(mt.Plan(**dp2, dp_mode="diloco", outer_lr=0.5),
                                   "plain-sgd", range(6)),
           "ddp-nesterov": _run(mt.Plan(**dp2), nesterov, range(6)),
           "local-sgd-2H": _run(mt.Plan(**dp2, dp_mode="local-sgd", sync_every=H), "adamw",
                                range(2 * H))}
    out["diloco-m1"] = _run(mt.Plan(**dp2, **DILOCO), "adamw", range(2 * H + 1))
    for m in (1, 2):   # the oracles of composition (SGD: AdamW amplifies round-off)
        out[f"oracle-m{m}"] = _run(mt.Plan(**dp2, **DILOCO, microbatches=m), "sgd",
                                   range(2 * H + 1))
    # resume at the sync (H) and in the middle of a round (H + 1)
    for cut in (H, H + 1):
        path = f"{folder}/cut{cut}"
        _run(mt.Plan(**dp2, **DILOCO), "adamw", range(cut), save=path)
        out[f"resumed-{cut}"] = _run(mt.Plan(**dp2, **DILOCO), "adamw",
                                     range(cut, 2 * H + 1), load=path)
    # from a DDP checkpoint: every worker starts from its parameters and optimizer state
    out["ddp-saved"] = _run(mt.Plan(**dp2), "adamw", range(H), save=f"{folder}/ddp")
    out["from-ddp"] = _run(mt.Plan(**dp2, **DILOCO), "adamw", range(H, H), load=f"{folder}/ddp")
    # a warm-up of K DDP steps, then DiLoCo; resumed from a checkpoint inside the warm-up
    warm = mt.Plan(**dp2, **DILOCO, sync_warmup_steps=K)
    out["ddp-K"] = _run(mt.Plan(**dp2), "adamw", range(K))
    out["warm-K"] = _run(warm, "adamw", range(K))
    out["warm-whole"] = _run(warm, "adamw", range(K + 2 * H + 1))
    _run(warm, "adamw", range(K - 1), save=f"{folder}/warm")
    out["warm-resumed"] = _run(warm, "adamw", range(K - 1, K + 2 * H + 1),
                               load=f"{folder}/warm")
    return out


def world4_cases(folder: str) -> dict:
    trainer = mt.Trainer(eq.gpt(), mt.Plan(dp=4, **DILOCO), optimizer=eq.adamw)
    try:
        trainer.load(f"{folder}/cut{H}")   # two workers' state for four
        refused = ""
    except PlanError as exc:
        refused = str(exc)
    return {"refused": refused,
            "tp": _run(mt.Plan(dp=2, tp=2, **DILOCO), "sgd", range(2 * H + 1)),
            "pp": _run(mt.Plan(dp=2, pp=2, microbatches=2, **DILOCO), "sgd",
                       range(2 * H + 1))}


def _refusal(plan: mt.Plan, path: str) -> dict:
    """What loading `path` under `plan` says, and whether the model was left untouched."""
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), plan, optimizer=eq.adamw)
    before = trainer.full_state_dict()
    try:
        trainer.load(path)
        message = ""
    except PlanError as exc:
        message = str(exc)
    after = trainer.full_state_dict()
    return {"message": message, "untouched": all(torch.equal(after[n], v)
                                                  for n, v in before.items())}


def switch_cases(folder: str) -> dict:
    """Checkpoints that cross dp modes, and sync_every changed on resume."""
    dp2, local1 = dict(dp=2), dict(dp=2, dp_mode="local-sgd")
    # local SGD with H = 1 is DDP: two steps of one, then two of the other, are DDP's four
    out = {"ddp-sgd": _run(mt.Plan(**dp2), "sgd", range(4))}
    _run(mt.Plan(**local1), "sgd", range(2), save=f"{folder}/local1")
    out["local-to-ddp"] = _run(mt.Plan(**dp2), "sgd", range(2, 4), load=f"{folder}/local1")
    _run(mt.Plan(**dp2), "sgd", range(2), save=f"{folder}/ddp-sgd")
    out["ddp-to-local"] = _run(mt.Plan(**local1), "sgd", range(2, 4), load=f"{folder}/ddp-sgd")
    # DiLoCo (AdamW) saved at its sync, into plans keeping one replica; mid-round: refused
    sync, mid = f"{folder}/at-sync", f"{folder}/mid-round"
    out["diloco-sync"] = _run(mt.Plan(**dp2, **DILOCO), "adamw", range(H), save=sync)
    _run(mt.Plan(**dp2, **DILOCO), "adamw", range(H + 1), save=mid)
    out["into-ddp"] = _run(mt.Plan(**dp2), "adamw", range(H, H), load=sync)
    out["ddp-on"] = _run(mt.Plan(**dp2), "adamw", range(H, H + 1), load=sync)
    out["zero1-on"] = _run(mt.Plan(**dp2, zero=1), "adamw", range(H, H + 1), load=sync)
    out["into-local"] = _run(mt.Plan(**dp2, dp_mode="local-sgd", sync_every=H), "adamw",
                             range(H, H), load=sync)
    out["refused"] = _refusal(mt.Plan(**dp2), mid)
    # sync_every 2 -> 4 in the first round, and 4 -> 2 three steps into it
    four = dict(DILOCO, sync_every=4)
    out["h4"] = _run(mt.Plan(**dp2, **four), "adamw", range(4))
    _run(mt.Plan(**dp2, **DILOCO), "adamw", range(1), save=f"{folder}/h2-step1")
    out["h2-to-h4"] = _run(mt.Plan(**dp2, **four), "adamw", range(1, 4),
                           load=f"{folder}/h2-step1")
    _run(mt.Plan(**dp2, **four), "adamw", range(3), save=f"{folder}/h4-step3")
    out["h4-to-h2"] = _run(mt.Plan(**dp2, **DILOCO), "adamw", range(3, 4),
                           load=f"{folder}/h4-step3")
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("diloco"))


@pytest.fixture(scope="module")
def world2(folder):
    return run_ranks(2, world2_cases, folder, timeout=180)


def _assert_same(result: dict, ref: dict, atol: float, what: str) -> None:
    close = dict(rtol=0, atol=atol)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               **close, msg=lambda m: f"{what} losses: {m}")
    for name, value in ref["state"].items():
        torch.testing.assert_close(result["state"][name], value, **close,
                                   msg=lambda m: f"{what} {name}: {m}")


def test_special_cases_equal_ddp(world2):
    """H = 1 with inner SGD without momentum: local SGD, and DiLoCo with outer lr 1 and no
    momentum, train as DDP does (1e-6 on losses and parameters); with outer lr b and
    Nesterov momentum m, as DDP with Nesterov SGD at lr a*b and momentum m (1e-5)."""
    for rank in world2:
        for mode in ("local-sgd", "diloco-1"):
            _assert_same(rank[mode], rank["ddp"], 1e-6, mode)
        assert rank["ddp"]["losses"][-1] < rank["ddp"]["losses"][0]   # it did train
        # the outer momentum, its sign and the anchor: Nesterov SGD at lr 0.5 x 0.5
        _assert_same(rank["diloco-nesterov"], rank["ddp-nesterov"], 1e-5, "nesterov")


def test_bytes_per_h_steps(world2):
    """Over 2H steps the dp axis carries two parameter-sized all-reduces (DDP's gradient
    bytes of one step, less the per-step statistics DDP's last bucket carries) and one loss
    scalar per sync (between syncs a step returns its worker's own loss)."""
    for rank in world2:
        ddp, local = rank["ddp-1step"], rank["local-sgd-2H"]
        ring = lambda numel: ring_all_reduce_elements(numel, 2, rank["ddp"]["dp_rank"]) * 4
        assert ddp["traffic"]["grad"] == ring(ddp["numel"] + 1 + ddp["n_params"])
        for run in (local, rank["diloco-m1"]):
            assert run["traffic"]["pseudo-grad"] == 2 * ring(ddp["numel"]) > 0
            assert run["traffic"]["grad"] == 0
        assert local["traffic"]["loss"] == 2 * ring(1)
        assert rank["diloco-m1"]["traffic"]["loss"] == 2 * ring(1)   # 2H + 1 steps: 2 syncs


def test_sync_warmup_is_ddp_then_diloco(world2):
    """sync_warmup_steps=K: the first K steps are DDP's (AdamW, 1e-6, DDP's bytes to the
    byte), then two rounds of H; a checkpoint inside the warm-up resumes bit for bit."""
    for rank in world2:
        ddp, warm, whole = rank["ddp-K"], rank["warm-K"], rank["warm-whole"]
        _assert_same(warm, ddp, 1e-6, "warm-up")
        torch.testing.assert_close(torch.tensor(whole["losses"][:K]),
                                   torch.tensor(ddp["losses"]), rtol=0, atol=1e-6)
        assert warm["traffic"] == ddp["traffic"]
        ring = lambda numel: ring_all_reduce_elements(numel, 2, whole["dp_rank"]) * 4
        assert whole["traffic"] == {"grad": ddp["traffic"]["grad"], "loss": 2 * ring(1),
                                    "pseudo-grad": 2 * ring(whole["numel"])}
        resumed = rank["warm-resumed"]
        assert resumed["losses"] == whole["losses"][K - 1:]
        for name, value in whole["state"].items():
            assert torch.equal(resumed["state"][name], value), name


def test_resume_is_exact(world2):
    """2H + 1 steps in one run against the same split by a checkpoint at H (a sync) and at
    H + 1 (mid-round: every worker's own parameters and inner state come back): equal. A
    DDP checkpoint gives every worker its parameters and optimizer state."""
    for rank in world2:
        whole = rank["diloco-m1"]
        for cut in (H, H + 1):
            resumed = rank[f"resumed-{cut}"]
            assert resumed["losses"] == whole["losses"][cut:], cut
            for name, value in whole["state"].items():
                assert torch.equal(resumed["state"][name], value), (cut, name)
            for name, states in whole["optimizer"].items():
                for key, value in states.items():
                    assert torch.equal(torch.as_tensor(resumed["optimizer"][name][key]),
                                       torch.as_tensor(value)), (cut, name, key)
        ddp, loaded = rank["ddp-saved"], rank["from-ddp"]
        for name, value in ddp["state"].items():
            assert torch.equal(loaded["state"][name], value), name
            state = loaded["optimizer"][name]
            assert torch.equal(state["diloco_anchor"], value), name
            for key in ("exp_avg", "exp_avg_sq"):
                for worker in (0, 1):
                    assert torch.equal(state[f"worker{worker}_{key}"],
                                       ddp["optimizer"][name][key]), (name, key)
            assert torch.equal(state["worker_step"], ddp["optimizer"][name]["step"])


def test_composes_with_tp_and_pp(world2, folder):
    """dp=2 x tp=2 and dp=2 x pp=2 on 4 ranks run the same DiLoCo as dp=2 on the whole model
    (SGD with momentum inside, Nesterov outside, two syncs and a step), to 1e-5. And a
    checkpoint of two workers does not load into four."""
    ranks = run_ranks(4, world4_cases, folder, timeout=180)
    for rank in ranks:
        assert "DiLoCo state is for another number of dp workers than dp=4" in rank["refused"]
        for case, oracle_case in (("tp", "oracle-m1"), ("pp", "oracle-m2")):
            # mid-round the workers differ: each against the oracle's same worker
            oracle = world2[rank[case]["dp_rank"]][oracle_case]
            eq.assert_equivalent(dict(rank[case], norms=[]), dict(oracle, norms=[]),
                                 what=f"dp=2 x {case}=2")
            # each rank syncs only its tp slice / its stage: fewer bytes than the whole
            assert 0 < rank[case]["traffic"]["pseudo-grad"] < oracle["traffic"]["pseudo-grad"]


@pytest.fixture(scope="module")
def switched(folder):
    return run_ranks(2, switch_cases, folder, timeout=240)


def _assert_resumed(resumed: dict, whole: dict, start: int, atol: float, what: str,
                    optimizer: bool = True) -> None:
    """`resumed` (steps start.. from a checkpoint) ends where `whole` does."""
    close = dict(rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(whole["losses"][start:]), **close)
    torch.testing.assert_close(resumed["state"], whole["state"], **close)
    if optimizer:
        torch.testing.assert_close(resumed["optimizer"], whole["optimizer"], **close)


def test_local_sgd_and_ddp_checkpoints_cross(switched):
    """Local SGD with H = 1 trains as DDP (momentum SGD too: the workers' mean momentum is
    DDP's): 2 steps of one, saved, then 2 of the other train as 4 of DDP, either way (1e-6;
    into DDP, its momentum too)."""
    for rank in switched:
        _assert_resumed(rank["local-to-ddp"], rank["ddp-sgd"], 2, 1e-6, "local SGD -> DDP")
        _assert_resumed(rank["ddp-to-local"], rank["ddp-sgd"], 2, 1e-6, "DDP -> local SGD",
                        optimizer=False)   # local SGD's state holds each worker's


def test_diloco_at_a_sync_loads_into_one_replica(switched):
    """A DiLoCo checkpoint at a sync loads under DDP: the parameters (the anchor), each
    AdamW state the mean of the two workers' and the step count; ZeRO-1 then steps as DDP
    does. Under local SGD the outer momentum goes (it has none). Mid-round: refused by name,
    nothing loaded."""
    for rank in switched:
        saved, loaded = rank["diloco-sync"], rank["into-ddp"]
        differ = 0
        for name, value in saved["state"].items():
            state, got = saved["optimizer"][name], loaded["optimizer"][name]
            assert torch.equal(loaded["state"][name], value) and torch.equal(
                state["diloco_anchor"], value), name
            assert set(got) == {"step", "exp_avg", "exp_avg_sq"}, name
            assert torch.equal(got["step"], state["worker_step"])
            for key in ("exp_avg", "exp_avg_sq"):
                workers = state[f"worker0_{key}"], state[f"worker1_{key}"]
                assert torch.equal(got[key], (workers[0] + workers[1]) / 2), (name, key)
                differ += not torch.equal(*workers)
            local = rank["into-local"]["optimizer"][name]
            assert "diloco_momentum" in state and "diloco_momentum" not in local, name
            assert torch.equal(local["diloco_anchor"], value), name
        assert differ > 0   # the workers' states differ: the mean is not one of them
        eq.assert_equivalent(dict(rank["zero1-on"], norms=[]), dict(rank["ddp-on"], norms=[]),
                             what="zero=1 from a DiLoCo checkpoint")
        refused = rank["refused"]
        assert ("saved by dp_mode='diloco' 1 inner step(s) after its last sync" in
                refused["message"] and "dp_mode='ddp' keeps one replica" in refused["message"])
        assert refused["untouched"]


def test_sync_every_changed_on_resume(switched):
    """sync_every changed on resume: the round goes on to the new H (2 -> 4 after one step:
    as H = 4 throughout), or, already longer (4 -> 2 after three), ends at the next step, as
    H = 4's does at step 4; bit for bit."""
    for rank in switched:
        _assert_resumed(rank["h2-to-h4"], rank["h4"], 1, 0, "H 2 -> 4")
        _assert_resumed(rank["h4-to-h2"], rank["h4"], 3, 0, "H 4 -> 2")
        assert rank["h4-to-h2"]["traffic"]["pseudo-grad"] > 0   # the round ended: a sync
