"""ZeRO-3 under pipeline stages (zero3.py, [Note: ZeRO-3 under pipeline stages]): one
process's training under dp2 x pp2 with each schedule (pairwise with tp, the tied model, a
transformers model, AdamW and a meta build), the bytes each collective moves and the
memory at rest and during a step against the policy's theory, checkpoints across plans;
the same for Plan.zero3_regather (1F1B, GPipe, naive, interleaved), beside the default
policy.

One world of 4 ranks runs every 4-rank case, one of 8 the tp case (a start costs more than
a case). Three steps each: a step's gathers, accumulation over micro-batches, scatter and
momentum are all exercised by then."""
import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.comm import ring_half_elements
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank.test_zero import PEER_MARGIN
from tests.multirank.test_zero3 import step_accounting

STEPS = 3
DP2_PP2 = dict(dp=2, pp=2, zero=3)
# (plan fields, model, optimizer, max_grad_norm): 1F1B, GPipe, interleaved at M = 2..4
# (zero bubble: the tp case), AdamW once
CASES = [(dict(schedule="1f1b", microbatches=4), "gpt", "sgd", None),
         (dict(schedule="gpipe", microbatches=2), "gpt", "adamw", None),
         (dict(schedule="interleaved", microbatches=4, virtual_stages=2), "gpt", "sgd", None),
         # a weight tied across the stages (embedding and output layer), clipped
         (dict(schedule="1f1b", microbatches=4), "tied_pipe", "sgd", 1.0)]
# Plan.zero3_regather (units gathered for each micro-batch's forward and backward): 1F1B
# at M = 4, GPipe with the weight tied across stages, naive (one micro-batch), interleaved
REGATHER = [(dict(schedule="1f1b", microbatches=4, zero3_regather=True), "gpt", "sgd", None),
            (dict(schedule="gpipe", microbatches=2, zero3_regather=True), "tied_pipe", "sgd",
             1.0),
            (dict(schedule="naive", microbatches=1, zero3_regather=True), "gpt", "sgd", None),
            (dict(schedule="interleaved", microbatches=4, virtual_stages=2,
                  zero3_regather=True), "gpt", "sgd", None)]


def train_cases(cases) -> list[dict]:
    return [eq.train(mt.Plan(**DP2_PP2, **plan), model, optimizer, steps=STEPS,
                     max_grad_norm=clip) for plan, model, optimizer, clip in cases]


def hf_case() -> dict | None:
    try:
        from tests.multirank import hf_cases  # noqa: F401  (registers the presets in eq.MODELS)
    except ImportError:   # no transformers: its test skips
        return None
    return eq.train(mt.Plan(**DP2_PP2, schedule="1f1b", microbatches=2), "llama-tiny-tied",
                    steps=STEPS)


def spanning_unit_refused() -> str:
    """A wrapping unit no stage calls whole (the GPT's block list, spread over stages)."""
    try:
        mt.Trainer(eq.gpt(), mt.Plan(**DP2_PP2, zero3_units=["blocks"]), optimizer=eq.sgd)
    except mt.PlanError as exc:
        return str(exc)
    return "accepted"


def four_ranks(path: str) -> dict:
    # the peer for AdamW's tolerance: torch's DDP on the same batches, 2 micro-batches
    return {"cases": train_cases(CASES), "hf": hf_case(), "refused": spanning_unit_refused(),
            "accounting": step_accounting(4, dict(**DP2_PP2, schedule="1f1b")),
            "regather": train_cases(REGATHER),
            # both policies on the GPT of 8 layers: 4 units a stage
            "policies": [step_accounting(4, dict(**DP2_PP2, schedule="1f1b",
                                                 zero3_regather=regather), eq.gpt_pipe)
                         for regather in (False, True)] + [step_accounting(
                             4, dict(**DP2_PP2, schedule="interleaved", virtual_stages=2,
                                     zero3_regather=True), eq.gpt_pipe)],
            "peer": eq.train_torch_ddp("gpt", "adamw", steps=STEPS, microbatches=2),
            "checkpoints": save_and_resume(path)}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(4, four_ranks, str(tmp_path_factory.mktemp("z3pp")), timeout=240)


def test_every_schedule_matches_one_process(four):
    refs = {(m, o, c): eq.reference(m, o, steps=STEPS, max_grad_norm=c)
            for _, m, o, c in CASES}
    for rank, r in enumerate(four):
        for (plan, model, optimizer, clip), result in zip(CASES, r["cases"]):
            ref = refs[(model, optimizer, clip)]
            atol = 1e-5 if optimizer == "sgd" else max(1e-5,
                                                       PEER_MARGIN * eq.drift(r["peer"], ref))
            eq.assert_equivalent(result, ref, atol=atol,
                                 what=f"rank {rank} zero=3 dp2 pp2 {plan} {model} {optimizer}")


def test_a_transformers_model_matches_one_process(four):
    pytest.importorskip("transformers")
    from tests.multirank import hf_cases as hf
    ref = hf.reference("llama-tiny-tied", steps=STEPS)
    for rank, r in enumerate(four):
        eq.assert_equivalent(r["hf"], ref, what=f"rank {rank} llama-tiny-tied zero=3 dp2 pp2")


def test_bytes_per_collective_and_memory_are_the_policys(four):
    for r in four:
        r = r["accounting"]
        lengths = dict(r["units"])   # this stage's units -> padded length, a multiple of dp
        psi = sum(lengths.values())
        assert all(k % 2 == 0 for k in lengths.values())
        # the stage's own parameters only, and each in exactly one of its units
        shapes = dict(eq.gpt().named_parameters())
        assert psi == sum(shapes[n].numel() for n in r["stage"])   # no padding at dp = 2
        # per step, whatever M: each unit gathered once, reduce-scattered once (ring half)
        half = sum(ring_half_elements(k, 2, r["rank"]) for k in lengths.values()) * 4
        assert (r["ag"]["calls"], r["rs"]["calls"]) == (len(lengths), len(lengths))
        assert r["ag"]["sent"] == r["rs"]["sent"] == half == psi * 4 // 2
        # at rest: parameters, gradients and AdamW's two moments as 1/dp shards (+ a step
        # counter per flat shard), nothing gathered
        rep = r["report"]
        assert r["gathered_now"] == 0
        assert (rep["parameters"], rep["gradients"]) == (4 * psi // 2, 4 * psi // 2)
        assert rep["optimizer_states"] == 8 * psi // 2 + 4 * r["tensors"]
        # during the step: the whole stage gathered at once, its gradients whole
        assert r["gathered_peak"] == 4 * psi
        assert rep["gradients_in_flight"] == 4 * psi


def test_regathering_each_microbatch_matches_one_process(four):
    refs = [eq.reference(m, o, steps=STEPS, max_grad_norm=c) for _, m, o, c in REGATHER]
    for rank, r in enumerate(four):
        for (plan, model, _, _), result, ref in zip(REGATHER, r["regather"], refs):
            eq.assert_equivalent(result, ref, what=f"rank {rank} zero=3 dp2 pp2 {plan} {model}")


def test_regathering_moves_m_times_the_bytes_and_holds_two_units(four):
    m = 4
    for r in four:
        kept, r, interleaved = r["policies"]
        # two chunks a rank (interleaved): each chunk's units prefetch only within it, and a
        # backward reduce-scatters only its chunk's, so the bytes and calls are 1F1B's, and
        # the gathered peak two units
        assert [k for _, k in interleaved["units"]] == [k for _, k in r["units"]]
        assert (interleaved["ag"], interleaved["rs"]) == (r["ag"], r["rs"])
        assert interleaved["gathered_peak"] == r["gathered_peak"]
        assert r["units"] == kept["units"]   # the same units, laid out alike
        sizes = [k for _, k in r["units"]]   # padded lengths, in backward order
        half = sum(ring_half_elements(k, 2, r["rank"]) for k in sizes) * 4
        # per step: every unit gathered for each micro-batch's forward and again for its
        # backward (none kept between: another micro-batch may run first), its gradients
        # reduce-scattered each micro-batch
        assert (r["ag"]["calls"], r["rs"]["calls"]) == (2 * m * len(sizes), m * len(sizes))
        assert (r["ag"]["sent"], r["rs"]["sent"]) == (2 * m * half, m * half)
        # during the step: a unit computing and its neighbour prefetched, never the stage;
        # the default policy holds the whole stage (measured in the same world)
        assert r["gathered_peak"] == 4 * max(a + b for a, b in zip(sizes, sizes[1:]))
        assert r["gathered_peak"] < kept["gathered_peak"] == 4 * sum(sizes)
        # at rest the same shards as the default policy, nothing gathered
        assert r["gathered_now"] == 0
        for kind in ("parameters", "gradients", "optimizer_states"):
            assert r["report"][kind] == kept["report"][kind], kind
        # gradients: a unit's bucket filling while the two before it are reduce-scattered
        # (two in flight), against the stage's whole gradients
        flight = r["report"]["gradients_in_flight"]
        assert flight == 4 * sum(sorted(sizes)[-3:]) < kept["report"]["gradients_in_flight"]


def eight_ranks() -> dict:
    # tp inside the stages, zero bubble's weight pass, the model built on the meta device
    return eq.train(mt.Plan(**DP2_PP2, tp=2, schedule="zb-h1", microbatches=2), "gpt",
                    steps=STEPS, meta=True)


def test_with_tensor_parallel_and_a_meta_build_matches_one_process():
    ref = eq.reference("gpt", steps=STEPS)
    for rank, result in enumerate(run_ranks(8, eight_ranks, timeout=240)):
        eq.assert_equivalent(result, ref, what=f"rank {rank} zero=3 dp2 pp2 tp2 zb-h1 meta")


# ---- checkpoints ----------------------------------------------------------------------------
def save_and_resume(path: str) -> dict:
    """Two steps under dp2 x pp2 zero=3, saved; loaded under dp4 zero=1, two more steps.
    Two steps under dp4, saved; loaded under dp2 x pp2 zero=3, two more."""
    out = {}
    for name, first, then in (("from_z3pp", dict(**DP2_PP2, microbatches=2), dict(dp=4, zero=1)),
                              ("to_z3pp", dict(dp=4), dict(**DP2_PP2, microbatches=2))):
        losses = []
        for i, plan in enumerate((first, then)):
            torch.manual_seed(i)   # the second build's values come from the checkpoint
            trainer = mt.Trainer(eq.gpt(), mt.Plan(**plan), optimizer=eq.adamw)
            if i:
                trainer.load(f"{path}/{name}")
            batches = eq.batches("gpt", 4, trainer.dp_rank, trainer.dp_size)[2 * i:2 * i + 2]
            losses += [trainer.step(x, y) for x, y in batches]
            if not i:
                trainer.save(f"{path}/{name}")
        out[name] = {"losses": losses, "state": eq.on_host(trainer.full_state_dict())}
    return out


def test_checkpoints_load_across_plans(four):
    ref = eq.reference("gpt", "adamw", steps=4)
    for r in four:
        for name, got in r["checkpoints"].items():
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                       rtol=0, atol=1e-5, msg=name)
            for key, value in ref["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5,
                                           msg=f"{name} {key}")


# ---- bad input -------------------------------------------------------------------------------
def test_a_unit_spanning_stages_is_refused_by_name(four):
    for r in four:
        assert r["refused"].startswith("ZeRO-3 wrapping units ['blocks'] are not called "
                                       "inside one pipeline stage"), r["refused"]
