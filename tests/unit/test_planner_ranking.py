"""`plan --verify --rank`: the rank correlation and the choice of plans to run."""
import json

import pytest

from meshtrain.measure.ranking import as_verify_plan, choose_plans, rank_report, spearman
from tests.synthetic_profile import synthetic_profile


def test_spearman_against_hand_computed_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair among 4: 1 - 6*2/(4*15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties take the average rank: ranks (1.5, 1.5, 3) vs (1, 2, 3)
    assert spearman([5, 5, 7], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)


def _row(name, predicted, measured):
    return {"plan": name, "predicted": {"step": predicted}, "measured": {"step": measured}}


def test_rank_report_says_how_far_the_predicted_best_is_behind():
    rows = [_row("a", 1.0, 1.10), _row("b", 2.0, 1.00), _row("c", 3.0, 3.0)]
    result, text = rank_report(rows)
    assert result["predicted_best"] == "a" and result["measured_best"] == "b"
    assert result["behind"] == pytest.approx(0.10) and result["measured_place"] == 2
    assert "#2, 10.0% behind the measured best (b)" in text


PROFILE = synthetic_profile(worlds=("4",), cpu_count=4)   # a 4-rank machine


def test_the_chosen_plans_are_runnable_verify_plans():
    from meshtrain.core.plan import Plan

    plans = choose_plans(PROFILE, world=4, global_batch=16, top=3, others=9, seed=0)
    assert len(plans) == 12
    assert len({json.dumps(p, sort_keys=True) for p in plans}) == len(plans)  # no repeats
    for fields, per_rank in plans:
        plan = Plan(**fields)
        assert plan.world_size == 4 and plan.dp * per_rank == 16
        assert per_rank % plan.microbatches == 0
        assert not plan.sequence_parallel and plan.offload == "none"


def test_the_sample_spans_the_rest_of_the_predicted_order():
    """One plan from each equal slice of the rest's predicted order: the sample reaches the
    slowest slice, and never two from one slice."""
    from meshtrain.planner.advisor import advise
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.profile import cluster_from_profile
    from meshtrain.measure.ranking import runnable
    from meshtrain.planner.setup import Setup
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.measure.verify import MODEL

    setup = Setup(global_batch=16, micro_batch=0, precision="fp32", optimizer="adam",
                  recompute="", sequence_parallel=False)
    ranked = [ev.cand for ev in advise(from_gpt_config(GPTConfig(**MODEL), "gpt"), setup,
                                       cluster_from_profile(PROFILE, 4)).ranked if runnable(ev.cand)]
    verify_form = [json.dumps(as_verify_plan(c, 16), sort_keys=True) for c in ranked]
    plans = [json.dumps(p, sort_keys=True) for p in choose_plans(PROFILE, 4, 16, 3, 9, seed=1)]
    assert plans[:3] == verify_form[:3]
    rest = len(ranked) - 3
    slices = [(verify_form.index(p) - 3) * 9 // rest for p in plans[3:]]
    assert slices == list(range(9))


def test_rank_repeats_each_plan_the_rounds_given(monkeypatch, tmp_path):
    from meshtrain.cli.main import main
    from meshtrain.measure import ranking

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    asked = []

    class Ran(Exception):
        pass

    def ran(profile, plans, rounds, **_):
        asked.append(rounds)
        raise Ran()

    monkeypatch.setattr(ranking, "verify", ran)
    for argv, rounds in ((["--rounds", "2"], 2), ([], ranking.ROUNDS)):
        with pytest.raises(Ran):
            main(["plan", "--verify", "--rank", "--profile", str(path), *argv])
        assert asked.pop() == rounds
