"""transformers mixtures of experts (meshtrain/models/hf_presets.py MOE: Mixtral, Qwen3-MoE,
OLMoE, 4 experts, top-2) with their router's load-balancing loss on, under the plans they run
today, equal to one process computing what transformers computes on the global batch: the
cross-entropy + router_aux_loss_coef x its own load-balancing loss (tests/multirank/hf_cases.py).
Mixtral takes every plan the dense families take (dp, ZeRO-1/2/3, recompute, bf16, pp); the
other two dp and ZeRO-3, OLMoE pp under zero bubble too. The step's loss is reported in its parts."""
from __future__ import annotations

import pytest
import torch

import meshtrain as mt
from meshtrain.models.hf_presets import build
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases as hf
from tests.multirank.test_hf_models import check_bf16

pytest.importorskip("transformers")

STEPS = 3
PLANS = {
    1: [(dict(), "mixtral-tiny"), (dict(recompute="full"), "qwen3-moe-tiny"),
        (dict(precision="bf16"), "mixtral-tiny")],
    2: [(dict(dp=2), "mixtral-tiny"), (dict(dp=2, zero=1), "mixtral-tiny"),
        (dict(dp=2, zero=2), "mixtral-tiny"), (dict(dp=2, zero=3), "mixtral-tiny"),
        (dict(dp=2, recompute="full"), "mixtral-tiny"),
        (dict(dp=2, zero=1, precision="bf16"), "mixtral-tiny"),
        (dict(dp=2), "qwen3-moe-tiny"), (dict(dp=2, zero=3), "qwen3-moe-tiny"),
        (dict(dp=2), "olmoe-tiny"), (dict(dp=2, zero=3), "olmoe-tiny"),
        (dict(dp=2, zero=1, microbatches=2, recompute="full"), "mixtral-tiny"),
        (dict(pp=2), "mixtral-tiny"), (dict(pp=2, schedule="zb-h1"), "olmoe-tiny")],
}   # micro-batches: against one process accumulating (reference_accumulating); pp=2 (1F1B,
#     zero bubble): the router's loss carried through the stages (models/moe.py)


def train_with_parts(cases: list[tuple[dict, str]]) -> list[dict]:
    """Each case trained STEPS steps on this rank; with each step's loss parts."""
    results = []
    for plan, model in cases:
        torch.manual_seed(0)
        trainer = mt.Trainer(build(model), mt.Plan(**plan), optimizer=eq.sgd)
        losses, parts = [], []
        for x, y in eq.batches(model, STEPS, trainer.dp_rank, trainer.dp_size):
            losses.append(trainer.step(x, y))
            parts.append(trainer.last_loss_parts)
        results.append(eq.on_host({"losses": losses, "parts": parts,
                                   "state": trainer.full_state_dict(),
                                   "optimizer": trainer.full_optimizer_state()["state"],
                                   "norms": []}))
    return results


def first_step_parts(model: str) -> dict:
    """What transformers computes on the first global batch, before any step."""
    torch.manual_seed(0)
    net = build(model)
    x, y = next(iter(eq.batches(model, 1)))
    with torch.no_grad():
        output = net(x, use_cache=False)
    return {"cross_entropy": hf.token_loss(output, y).item(), "router_aux": output.aux_loss.item()}


def reference_accumulating(model: str, dp: int, microbatches: int) -> dict:
    """One process accumulating gradients over the global micro-batches: micro-batch m of
    every dp rank's shard together, each with its own router loss (models/moe.py's note)."""
    torch.manual_seed(0)
    net = build(model)
    opt, loss_fn = eq.sgd(net.parameters()), hf.transformers_loss(net)
    shards = [eq.batches(model, STEPS, r, dp) for r in range(dp)]
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        pieces = [[t.chunk(microbatches) for t in shards[r][step]] for r in range(dp)]
        total = 0.0
        for m in range(microbatches):
            x, y = (torch.cat([pieces[r][i][m] for r in range(dp)]) for i in (0, 1))
            loss = loss_fn(net(x, use_cache=False), y) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    names = {id(p): n for n, p in net.named_parameters()}
    return {"losses": losses, "state": dict(net.state_dict()), "norms": [],
            "optimizer": {names[id(p)]: s for p, s in opt.state.items()}}


@pytest.fixture(scope="module")
def references():
    cases = [case for world in PLANS for case in PLANS[world]]
    in_bf16 = {m for plan, m in cases if plan.get("precision") == "bf16"}
    refs = {m: (hf.reference(m, steps=STEPS),
                hf.reference_bf16(m, steps=STEPS) if m in in_bf16 else None,
                first_step_parts(m)) for m in {m for _, m in cases}}
    refs["accumulating"] = reference_accumulating("mixtral-tiny", dp=2, microbatches=2)
    return refs


def test_micro_batches_are_not_one_forward_of_the_whole_batch(references):
    """The relation the micro-batch case checks is its own: each global micro-batch's router
    loss is not the whole batch's (else the case would prove nothing beyond the others)."""
    accumulating, whole = references["accumulating"], references["mixtral-tiny"][0]
    assert max(abs(a - b) for a, b in zip(accumulating["losses"], whole["losses"])) > 1e-5


@pytest.mark.parametrize("world", [1, 2])
def test_router_loss_kept_under_every_plan(references, world):
    cases = PLANS[world]
    per_rank = ((train_with_parts(cases),) if world == 1
                else run_ranks(world, train_with_parts, cases, timeout=170))
    for rank, results in enumerate(per_rank):
        for (plan, model), result in zip(cases, results):
            what = f"{model} rank {rank} {mt.Plan(**plan).describe()}"
            fp32, bf16, first = references[model]
            if plan.get("precision") == "bf16":
                check_bf16(result, bf16, exact=world == 1, what=what)
                continue
            if plan.get("microbatches", 1) > 1:
                fp32 = references["accumulating"]
                first = None
            eq.assert_equivalent(result, fp32, what=what)
            # the parts: the first step's as transformers computes them on the global batch,
            # and every step's loss their sum (coefficient 0.02), within fp32 round-off
            if first is not None:
                torch.testing.assert_close(result["parts"][0], first, rtol=1e-6, atol=0,
                                           msg=lambda m: f"{what} parts: {m}")
            for loss, parts in zip(result["losses"], result["parts"]):
                assert loss == pytest.approx(
                    parts["cross_entropy"] + 0.02 * parts["router_aux"], rel=1e-6), what


def test_a_run_reports_the_loss_in_its_parts(tmp_path, capsys):
    """`meshtrain train --model mixtral-tiny`'s rank (one, in this process): each step of
    metrics.jsonl and the summary give the cross-entropy and the router's loss beside it."""
    import json

    from meshtrain.cli.summary import print_summary
    from meshtrain.train.config import RunConfig
    from meshtrain.train.run import train_rank

    config = RunConfig(run_dir=str(tmp_path), plan=mt.Plan().to_dict(), model="mixtral-tiny",
                       steps=2, batch_size=4, seq_len=16, optimizer="sgd", lr=0.1, warmup=0,
                       eval_every=100, eval_batches=1, ckpt_every=100, progress=False)
    summary = train_rank(config)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:   # near its balanced value: E x sum_e (k/E)(1/E) = k = 2
        assert 1.9 < m["router_aux"] < 2.5, m
        assert m["loss"] == pytest.approx(m["cross_entropy"] + 0.02 * m["router_aux"], rel=1e-6)
    assert summary["train_loss_parts_end"] == {k: steps[-1][k]
                                               for k in ("cross_entropy", "router_aux")}
    print_summary(summary)
    assert f"router load-balancing {steps[-1]['router_aux']:.4f}" in capsys.readouterr().out
