"""Expert parallel (strategies/expert_parallel): the experts of every MoE layer split over ep
ranks carved from dp, equal to one process computing what transformers computes on the global
batch (cross-entropy + router_aux_loss_coef x the load-balancing loss), SGD with momentum,
1e-5; with the bytes each collective moved checked against what the step routed.

Cases pairwise over (model, ep, dp): ep = dp = 2 and ep = dp = 4, and ep = 2 inside dp = 4
(edp groups of 2), across Mixtral (top-2 renormalised) and Qwen3-MoE (norm_topk_prob); and
ZeRO-1 and ZeRO-3, each expert's states (and under ZeRO-3 its weights) sharded over its edp
group; with tensor parallel (attention split over tp, experts whole over tp and split over
ep), on OLMoE (top-k not renormalised); recomputation with micro-batches (against one process accumulating over the global
micro-batches), and bf16 (within bf16's round-off, as test_hf_moe.py's); with pipeline
stages (dp 2 x pp 2, the interleaved schedule, and 1F1B with a capacity factor; each
stage's experts over its own ep groups, the router's loss carried through the stages:
models/moe.py). A checkpoint saved
under ep loads whole under Plan(dp); a run's metrics give the tokens per expert."""
from __future__ import annotations

import math

import pytest
import torch

import meshtrain as mt
from meshtrain.core.comm import ring_all_reduce_elements, ring_half_elements
from meshtrain.models.hf_presets import build, config_of
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases as hf
from tests.multirank.test_hf_models import check_bf16
from tests.multirank.test_hf_moe import first_step_parts, reference_accumulating

pytest.importorskip("transformers")

STEPS = 3
CAPACITY = 1.0   # drops some choices of the tiny Mixtral's random routing (asserted)
CASES = {2: [(dict(dp=2, ep=2), "mixtral-tiny"), (dict(dp=2, ep=2), "qwen3-moe-tiny"),
             (dict(dp=2, ep=2, capacity_factor=CAPACITY), "mixtral-tiny"),
             (dict(dp=2, ep=2, recompute="full", microbatches=2), "mixtral-tiny"),
             (dict(dp=2, ep=2, precision="bf16"), "mixtral-tiny"),
             (dict(dp=2, ep=2), "qwen2-moe-tiny")],   # a shared expert beside the routed
         4: [(dict(dp=4, ep=4), "mixtral-tiny"), (dict(dp=4, ep=2), "qwen3-moe-tiny"),
             (dict(dp=4, ep=2, zero=1), "mixtral-tiny"),
             (dict(dp=4, ep=2, zero=3), "qwen3-moe-tiny"),
             (dict(dp=4, ep=2, zero=3, capacity_factor=CAPACITY), "mixtral-tiny"),
             (dict(dp=2, tp=2, ep=2, zero=1), "olmoe-tiny"),
             (dict(dp=2, pp=2, ep=2, zero=1, schedule="interleaved", virtual_stages=2,
                   microbatches=2, recompute="full"), "qwen3-moe-tiny"),
             (dict(dp=2, pp=2, ep=2, capacity_factor=CAPACITY), "mixtral-tiny")]}


def train_observed(cases: list[tuple[dict, str]], save_dir: str | None = None) -> list[dict]:
    """Each case trained STEPS steps on this rank, with every step's counters and routing;
    with `save_dir`, the first case's checkpoint loaded under Plan(dp) (experts whole)."""
    results = []
    for plan, model in cases:
        torch.manual_seed(0)
        trainer = mt.Trainer(build(model), mt.Plan(**plan), optimizer=eq.sgd)
        losses, parts, traffic, routed = [], [], [], []
        for x, y in eq.batches(model, STEPS, trainer.dp_rank, trainer.dp_size):
            trainer.comm.stats.reset()
            losses.append(trainer.step(x, y))
            parts.append(trainer.last_loss_parts)
            traffic.append(trainer.comm.stats.snapshot())
            routed.append(trainer.sharding.routed())
            if trainer.capacity is not None:   # this rank's [routed, dropped] per layer
                routed[-1]["capacity"] = trainer.capacity.take()
        # elements this rank holds whole before any ZeRO sharding: its experts, the rest
        numel = {n: math.prod(trainer.layout.shapes[n]) for n, _ in
                 trainer.stages.named_parameters()}
        experts = sum(numel[n] // plan["ep"] for n in trainer.sharding.experts if n in numel)
        dense = sum(k for n, k in numel.items() if n not in trainer.sharding.experts)
        results.append(eq.on_host({
            "losses": losses, "parts": parts, "traffic": traffic, "routed": routed,
            "numel": (experts, dense), "params": len(trainer.stages.named_parameters()),
            "dp_rank": trainer.dp_rank, "pp_rank": trainer.mesh.axis_rank("pp"), "held": [any(n.startswith(f"{layer}.") for n in numel)
                                                 for layer in trainer.sharding.layers],
            "state": trainer.full_state_dict(), "norms": [],
            "optimizer": trainer.full_optimizer_state()["state"]}))
        if save_dir is not None and len(results) == 1:
            results[0]["reloaded"] = reloaded_without_ep(trainer, model, plan["dp"], save_dir)
    return results


def reloaded_without_ep(trainer, model: str, dp: int, path: str) -> float:
    """The largest difference between `trainer`'s state and optimizer state and what a
    Plan(dp=dp) trainer loads from its checkpoint."""
    trainer.save(path)
    other = mt.Trainer(build(model), mt.Plan(dp=dp), optimizer=eq.sgd)
    other.load(path)
    pairs = list(zip(*(t.full_state_dict().values() for t in (trainer, other))))
    mine, theirs = (t.full_optimizer_state()["state"] for t in (trainer, other))
    pairs += [(v, theirs[n][k]) for n, s in mine.items() for k, v in s.items()]
    return max((a - b).abs().max().item() for a, b in pairs)


@pytest.fixture(scope="module")
def references():
    models = {m for cases in CASES.values() for _, m in cases}
    refs = {m: (hf.reference(m, steps=STEPS), first_step_parts(m)) for m in models}
    refs["accumulating"] = {m: reference_accumulating(m, dp=2, microbatches=2)
                            for m in ("mixtral-tiny", "qwen3-moe-tiny")}
    refs["bf16"] = hf.reference_bf16("mixtral-tiny", steps=STEPS)
    refs["capacity"] = hf.reference("mixtral-tiny", STEPS, capacity_factor=CAPACITY)
    return refs


def train_then_run(cases: list[tuple[dict, str]], run_dir: str | None) -> list[dict]:
    """`train_observed`, then (where `run_dir` is given) this rank of `meshtrain train
    --model mixtral-tiny --ep 2` writing its metrics there (the same ranks: no new start)."""
    from meshtrain.train.config import RunConfig
    from meshtrain.train.run import train_rank

    results = train_observed(cases, None if run_dir is None else f"{run_dir}/saved")
    if run_dir is not None:
        config = RunConfig(run_dir=run_dir, plan=mt.Plan(
                           dp=2, ep=2, capacity_factor=CAPACITY).to_dict(),
                           model="mixtral-tiny", steps=2, batch_size=4, seq_len=16,
                           optimizer="sgd", lr=0.1, warmup=0, eval_every=1, eval_batches=1,
                           ckpt_every=100, progress=False)
        train_rank(config)
    return results


@pytest.mark.parametrize("world", sorted(CASES))
def test_expert_parallel_equals_one_process(references, world, tmp_path, capsys):
    cases = CASES[world]
    run_dir = str(tmp_path) if world == 2 else None
    per_rank = run_ranks(world, train_then_run, cases, run_dir, timeout=170)
    if run_dir is not None:
        check_run_reports_expert_load(tmp_path)
        out = capsys.readouterr().out
        assert "imbalance max/mean" in out and "of the top-k choices" in out
        # saved under ep, loaded whole: the same state, the same optimizer state, exactly
        assert [r[0]["reloaded"] for r in per_rank] == [0.0] * world
    for rank, results in enumerate(per_rank):
        for (plan, model), result in zip(cases, results):
            what = f"{model} rank {rank} {mt.Plan(**plan).describe()}"
            ref, first = references[model]
            if plan.get("precision") == "bf16":
                check_bf16(result, references["bf16"], exact=False, what=what)
            elif plan.get("capacity_factor"):   # what one process with the same limit does
                eq.assert_equivalent(result, references["capacity"], what=what)
            elif plan.get("microbatches", 1) > 1:
                eq.assert_equivalent(result, references["accumulating"][model], what=what)
            else:
                eq.assert_equivalent(result, ref, what=what)
                torch.testing.assert_close(result["parts"][0], first, rtol=1e-6, atol=0,
                                           msg=lambda m: f"{what} parts: {m}")
            check_traffic(result, plan, model, result["dp_rank"], what)
    for i, (plan, _) in enumerate(cases):   # the limit did drop choices
        if plan.get("capacity_factor"):
            assert sum(step["capacity"][:, 1].sum().item() for r in per_rank
                       for step in r[i]["routed"]) > 0, plan


def check_traffic(result: dict, plan: dict, model: str, rank: int, what: str) -> None:
    """Expert gradients over the edp group only, dense ones over dp; the all-to-alls carry
    exactly the rows the step routed to other ranks, each way, forward and backward. `rank`:
    the dp rank."""
    config = config_of(model)
    dp, ep = plan["dp"], plan["ep"]
    edp, me = dp // ep, rank % ep           # dp rank r: ep rank r % ep, edp rank r // ep
    sent = lambda traffic, key: traffic.get(key, {"sent": 0})["sent"]   # 0: not a collective
    experts, dense = result["numel"]
    rows = eq.GLOBAL_BATCH // dp * hf.SEQ * config.num_experts_per_tok   # routed per layer
    row_bytes = config.hidden_size * (2 if plan.get("precision") == "bf16" else 4)
    for step, (traffic, routed) in enumerate(zip(result["traffic"], result["routed"])):
        at = f"{what} step {step}"
        if plan.get("precision") == "bf16":
            pass   # its gradient traffic is DDP's own in bf16 (test_ddp.py); the rows below
        elif plan.get("zero"):   # experts in buckets of their own (ZeRO-3: one per layer's
            # unit), each padded to a multiple of dp, reduce-scattered over edp
            layers = config.num_hidden_layers if plan["zero"] == 3 else 1
            padded = -(-experts // layers // dp) * dp
            scattered = layers * 4 * ring_half_elements(padded, edp, rank // ep)
            assert sent(traffic, "edp/reduce_scatter[grad]") == scattered, at
            if plan["zero"] == 1:   # and the updated experts gathered back once
                assert sent(traffic, "edp/all_gather[param]") == scattered, at
        elif plan.get("tp", 1) == 1:   # dense gradients + the step's statistics (loss, a
            # used-flag per parameter); under tp the dense ones are tp's slices
            stats = 1 + result["params"]
            assert traffic["dp/all_reduce[grad]"]["sent"] == 4 * ring_all_reduce_elements(
                dense + stats, dp, rank), at
            assert sent(traffic, "edp/all_reduce[grad]") == 4 * ring_all_reduce_elements(
                experts, edp, rank // ep), at
        # every routed row is sent somewhere: tokens x top-k per layer of this rank's stages
        # (less the choices a capacity dropped), this rank's own share stays (the counters
        # charge only the rows that leave the rank)
        kept = [rows if held else 0 for held in result["held"]]
        if "capacity" in routed:   # [routed, dropped] per layer
            assert routed["capacity"][:, 0].tolist() == kept, at
            kept = (routed["capacity"][:, 0] - routed["capacity"][:, 1]).tolist()
        layer_sent = routed["layer_sent"]
        assert layer_sent.shape == (config.num_hidden_layers, ep), at
        assert layer_sent.sum(dim=1).tolist() == kept, at
        leaving = (layer_sent.sum() - layer_sent[:, me].sum()).item() * row_bytes
        assert leaving > 0, at
        # recomputation runs each layer's forward, all-to-alls included, again in backward
        again = 2 if plan.get("recompute") == "full" else 1
        for key, way, times in (("ep-dispatch", "sent", again), ("ep-combine", "received", again),
                                ("ep-dispatch-grad", "received", 1),
                                ("ep-combine-grad", "sent", 1)):
            assert traffic[f"ep/all_to_all[{key}]"][way] == times * leaving, f"{at} {key}"
        assert routed["per_expert"].sum().item() == sum(kept), at
        if plan.get("pp", 1) > 1:
            check_stage_messages(traffic, plan, config, result["pp_rank"], at)


def check_stage_messages(traffic: dict, plan: dict, config, pp_rank: int, at: str) -> None:
    """Each activation or gradient between stages: a micro-batch's hidden state and the
    routing sums beside it, 2 x experts + 1 fp32 numbers whatever the sequence length
    (models/moe.py). A rank sends an activation from each of its stages but the last and a
    gradient from each but the first."""
    pp, chunks, m = plan["pp"], plan.get("virtual_stages", 1), plan.get("microbatches", 1)
    sends = 2 * chunks - (pp_rank == 0) - (pp_rank == pp - 1)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    tokens = eq.GLOBAL_BATCH // plan["dp"] // m * hf.SEQ
    message = 4 * (tokens * config.hidden_size + 2 * experts + 1)
    moved = sum(traffic.get(f"pp/send[{tag}]", {"sent": 0})["sent"] for tag in ("act", "grad"))
    assert moved == m * sends * message, at


def check_run_reports_expert_load(run_dir) -> None:
    """Each step of metrics.jsonl gives the tokens each expert of each layer received over
    the global batch and the choices the capacity dropped (together batch x seq x top-k per
    layer, evaluations not counted: eval_every=1), their imbalance, max / mean, and the
    fraction dropped; the summary prints the last step's."""
    import json

    from meshtrain.cli.summary import print_summary

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        tokens, dropped = m["expert_tokens"], m["expert_dropped"]
        assert [sum(n) + d for n, d in zip(tokens, dropped)] == [4 * 16 * 2] * 2, m
        assert m["expert_imbalance"] == pytest.approx(
            max(max(layer) / (sum(layer) / len(layer)) for layer in tokens)), m
        assert m["expert_drop_fraction"] == pytest.approx(sum(dropped) / (2 * 4 * 16 * 2)), m
    assert sum(sum(m["expert_dropped"]) for m in steps) > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = ("expert_tokens", "expert_imbalance", "expert_dropped", "expert_drop_fraction")
    assert summary["expert_load_end"] == {k: steps[-1][k] for k in keys}
    print_summary(summary)
