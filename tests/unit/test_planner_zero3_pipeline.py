"""The planner's pricing of ZeRO-3 under pipeline stages (zero3.py, [Note: ZeRO-3 under
pipeline stages]): each unit gathered once a step and kept to the stage's last backward,
gradients accumulated whole and reduce-scattered once. Expected values are written from
that policy, never computed by the function under test."""
import pytest

from meshtrain.core.admit import check_plan
from meshtrain.core.plan import Plan, PlanError
from meshtrain.planner import from_description, make_cluster
from meshtrain.planner.advisor import candidates_for
from meshtrain.planner.memory import stage_memories
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.states import stage_params
from meshtrain.planner.traffic import axis_bytes

# 8 layers, h 1024, 16 heads, a vocabulary of 32000, 2048 tokens a sequence
SPEC = from_description(8, 1024, 16, 32000, 2048)
SETUP = Setup(global_batch=32)


def _cand(**plan):
    return Candidate(Plan(**plan), 1, "none")


@pytest.mark.parametrize("m", [2, 8])
def test_bytes_per_step_are_one_gather_and_one_scatter_of_the_stage_whatever_m(m):
    psi = stage_params(SPEC, Plan(pp=2))   # the busiest stage's parameters
    per_step = 3 / 4 * psi * (SETUP.param_bytes + SETUP.grad_bytes)   # ring halves over dp 4
    out = axis_bytes(SPEC, _cand(dp=4, pp=2, zero=3, microbatches=m), SETUP)
    assert out["dp"] == pytest.approx(per_step)
    # DDP's volume (ZeRO-1's), where ZeRO-3 without stages moves about 1.5x that per
    # micro-batch
    assert out["dp"] == pytest.approx(axis_bytes(SPEC, _cand(dp=4, pp=2, zero=1,
                                                             microbatches=m), SETUP)["dp"])
    alone = axis_bytes(SPEC, _cand(dp=4, zero=3, microbatches=m), SETUP)["dp"]
    assert alone > m * per_step


def test_memory_per_stage_is_sharded_at_rest_and_whole_during_the_step():
    cand = _cand(dp=4, pp=2, zero=3, microbatches=4)
    for stage, mem in enumerate(stage_memories(SPEC, cand, SETUP)):
        psi = stage_params(SPEC, Plan(pp=2), stage)
        assert mem.params == pytest.approx(psi * SETUP.param_bytes / 4)
        assert mem.grads == pytest.approx(psi * SETUP.grad_bytes / 4)
        assert mem.optim == pytest.approx(psi * SETUP.optim_bytes / 4)
        # the stage's units all gathered and its gradients whole from the first forward to
        # the last backward
        assert mem.buffers == pytest.approx(psi * (SETUP.param_bytes + SETUP.grad_bytes))


def test_the_plan_is_admitted_and_the_advisor_enumerates_it():
    plan = Plan(dp=2, pp=2, tp=2, zero=3, microbatches=4, schedule="zb-h1")
    check_plan(plan, world_size=8)
    cluster = make_cluster("H100-80GB", 1, 8)
    plans = [c.plan for group in candidates_for(SPEC, SETUP, cluster) for c in group]
    assert any(p.zero == 3 and p.pp > 1 for p in plans)


def test_what_is_not_built_with_it_is_still_refused_by_name():
    # CUDA graphs replay fixed addresses: ZeRO-3's regathered units are named first
    with pytest.raises(PlanError, match="compile='cudagraphs' with this plan: zero=3 frees"):
        check_plan(Plan(dp=2, pp=2, zero=3, compile="cudagraphs"))


# ---- Plan.zero3_regather: each unit gathered for each micro-batch's forward and backward --------
@pytest.mark.parametrize("m", [2, 8])
def test_regathering_moves_m_times_two_gathers_and_a_scatter_of_the_stage(m):
    psi = stage_params(SPEC, Plan(pp=2))
    per_micro = 3 / 4 * psi * (2 * SETUP.param_bytes + SETUP.grad_bytes)   # ring halves, dp 4
    plan = dict(dp=4, pp=2, zero=3, microbatches=m)
    out = axis_bytes(SPEC, _cand(**plan, zero3_regather=True), SETUP)
    assert out["dp"] == pytest.approx(m * per_micro)
    assert out["dp"] > m * axis_bytes(SPEC, _cand(**plan), SETUP)["dp"]


def test_regathering_holds_two_units_and_a_units_gradients_not_the_stage():
    unit = SPEC.largest_layer_params
    plan = dict(dp=4, pp=2, zero=3, microbatches=4)
    kept = stage_memories(SPEC, _cand(**plan), SETUP)
    for stage, mem in enumerate(stage_memories(SPEC, _cand(**plan, zero3_regather=True), SETUP)):
        psi = stage_params(SPEC, Plan(pp=2), stage)
        assert mem.params == pytest.approx(psi * SETUP.param_bytes / 4)   # at rest: sharded
        assert mem.buffers == pytest.approx(unit * (2 * SETUP.param_bytes + SETUP.grad_bytes))
        assert mem.buffers < kept[stage].buffers


def test_the_advisor_offers_both_policies_under_stages():
    cluster = make_cluster("H100-80GB", 1, 8)
    plans = {(c.plan.zero3_regather, c.plan.schedule)
             for group in candidates_for(SPEC, SETUP, cluster) for c in group
             if c.plan.zero == 3 and c.plan.pp > 1}
    assert {(False, "1f1b"), (True, "1f1b"), (True, "gpipe"), (True, "interleaved")} <= plans
    assert (True, "zb-h1") not in plans


@pytest.mark.parametrize("fields, words", [
    (dict(dp=2, pp=2, zero=2), "zero3_regather chooses how ZeRO-3 gathers under pipeline "
                               "stages, but Plan.zero=2, pp=2"),
    (dict(dp=4, zero=3), "Plan.zero=3, pp=1 (at pp=1 ZeRO-3 gathers every micro-batch "
                         "already)"),
    (dict(dp=2, pp=2, zero=3, schedule="zb-h1"), "schedule='zb-h1' is not built (its weight "
                                                 "pass would gather the units a third time)"),
])
def test_regathering_where_it_is_not_built_or_meaningless_is_refused_by_name(fields, words):
    with pytest.raises(PlanError) as err:
        check_plan(Plan(**fields, zero3_regather=True))
    assert words in str(err.value)


def test_regathering_hides_behind_compute_as_at_pp1_and_the_kept_policy_does_not():
    from meshtrain.planner.time_model import dp_hidden
    cluster = make_cluster("H100-80GB", 1, 8)   # overlap 1 on GPUs
    plan = dict(dp=4, pp=2, zero=3, microbatches=4)
    # (hideable, compute): the prefetched gathers hide behind the step's compute, at most it
    for hideable, compute in ((2.0, 5.0), (5.0, 2.0)):
        got = dp_hidden(_cand(**plan, zero3_regather=True), cluster, hideable, compute, 1.0)
        assert got == pytest.approx(min(hideable, compute) * cluster.overlap)
        assert dp_hidden(_cand(**plan), cluster, hideable, compute, 1.0) == 0.0

