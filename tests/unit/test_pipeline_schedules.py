"""Pipeline schedules as data, with no process: every schedule over many (P, M, V) runs in
the simulator without deadlock, every send has its receive, every forward precedes its
backward, and the bubble equals theory; partitions; bad plans refused before any group."""
import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.strategies.pipeline.partition import balanced_cuts, check, stage_bounds
from meshtrain.strategies.pipeline.schedules import (COMPUTE, RECVS, SENDS, Action, Kind,
                                                     bubble_formula, build_schedule,
                                                     compute_order, evaluation_schedule,
                                                     message)
from meshtrain.strategies.pipeline.simulator import ScheduleError, simulate
from tests.multirank import equivalence as eq


def cases():
    for schedule in ("naive", "gpipe", "1f1b", "interleaved", "zb-h1"):
        for p in range(2, 7):
            for v in ((1, 2, 3, 4) if schedule == "interleaved" else (1,)):
                for m in range(1, 17):
                    if schedule == "interleaved" and m % p:
                        continue
                    yield schedule, p, m, v


CASES = list(cases())


def test_many_cases_are_covered():
    assert len(CASES) > 300


@pytest.mark.parametrize("costs", [(1.0, 1.0), (1.0, 2.0)])
def test_every_schedule_runs_and_its_bubble_equals_theory(costs):
    for schedule, p, m, v in CASES:
        actions = build_schedule(schedule, p, m, v)
        timeline = simulate(actions, *costs, virtual_stages=v)   # raises on a deadlock
        expected, _ = bubble_formula(schedule, p, m, v, *costs)
        if schedule == "zb-h1" and m < p:   # the formula needs M >= P: no worse than 1F1B
            assert timeline.bubble <= simulate(build_schedule("1f1b", p, m), *costs).bubble
            continue
        assert timeline.bubble == pytest.approx(expected, abs=1e-12), (schedule, p, m, v)


@pytest.mark.parametrize("costs", [(1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 3.0, 1.0),
                                   (1.0, 1.5, 0.25)])
def test_zb_h1_bubble_equals_the_papers_formula(costs):
    """Qi et al. 2023, table 1: ZB-H1 idles (P-1)(F+B-W) per rank, 1F1B (P-1)(F+B+W); with
    F = B = W the bubble is (P-1)/(3M+P-1), a third of 1F1B's idle time. M >= P, W <= B."""
    f, backward, w = costs
    for p in range(2, 7):
        for m in range(p, 17):
            zb = simulate(build_schedule("zb-h1", p, m), f, backward, weight_cost=w)
            one = simulate(build_schedule("1f1b", p, m), f, backward)
            expected, _ = bubble_formula("zb-h1", p, m, 1, f, backward, w)
            assert zb.bubble == pytest.approx(expected, abs=1e-12), (costs, p, m)
            idle_zb = zb.makespan * p - sum(zb.busy)
            idle_one = one.makespan * p - sum(one.busy)
            b = backward - w
            assert idle_zb == pytest.approx(p * (p - 1) * (f + b - w))
            assert idle_one == pytest.approx(p * (p - 1) * (f + b + w))
            if costs == (1.0, 2.0, 1.0):
                assert expected == pytest.approx((p - 1) / (3 * m + p - 1))
                assert idle_zb == pytest.approx(idle_one / 3)


def test_every_forward_precedes_its_backward_and_each_runs_once():
    for schedule, p, m, v in CASES:
        for rank, acts in enumerate(build_schedule(schedule, p, m, v)):
            forwards = [(a.microbatch, a.chunk) for a in acts if a.kind is Kind.FORWARD]
            backwards = [(a.microbatch, a.chunk) for a in acts if a.kind is Kind.BACKWARD]
            weights = [(a.microbatch, a.chunk) for a in acts
                       if a.kind is Kind.BACKWARD_WEIGHT]
            everything = {(i, c) for i in range(m) for c in range(v)}
            assert sorted(forwards) == sorted(backwards) == sorted(everything)
            assert sorted(weights) == (sorted(everything) if schedule == "zb-h1" else [])
            position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(acts)}
            for key in everything:
                assert position[(Kind.FORWARD, *key)] < position[(Kind.BACKWARD, *key)]
                if weights:
                    assert position[(Kind.BACKWARD, *key)] < position[(Kind.BACKWARD_WEIGHT,
                                                                        *key)]


def test_every_send_has_exactly_one_matching_receive():
    for schedule, p, m, v in CASES:
        actions = build_schedule(schedule, p, m, v)
        sent = [message(a, r, p) for r, acts in enumerate(actions) for a in acts
                if a.kind in SENDS]
        received = [message(a, r, p) for r, acts in enumerate(actions) for a in acts
                    if a.kind in RECVS]
        assert len(set(sent)) == len(sent)
        assert sorted(sent, key=repr) == sorted(received, key=repr)
        # each boundary between consecutive stages: M activations and M gradients
        assert len(sent) == 2 * m * (p * v - 1)


def test_one_f_one_b_holds_at_most_p_minus_r_microbatches_gpipe_all_of_them():
    def peak(order):
        held = top = 0
        for kind, _, _ in order:
            held += 1 if kind is Kind.FORWARD else -1
            top = max(top, held)
        return top

    for p in range(2, 7):
        for m in range(1, 17):
            for rank, order in enumerate(compute_order("1f1b", p, m)):
                assert peak(order) == min(p - rank, m)
            assert peak(compute_order("gpipe", p, m)[0]) == m


def test_zb_h1_holds_at_most_1f1bs_peak_on_every_rank():
    """Activations live from F to W: rank r defers r W's, so holds at most P, and stage 0
    exactly 1F1B's min(P, M)."""
    def peak(order):
        held = top = 0
        for kind, _, _ in order:
            held += {Kind.FORWARD: 1, Kind.BACKWARD_WEIGHT: -1}.get(kind, 0)
            top = max(top, held)
        return top

    for p in range(2, 7):
        for m in range(1, 17):
            peaks = [peak(order) for order in compute_order("zb-h1", p, m)]
            assert peaks[0] == min(p, m) and max(peaks) <= min(p, m), (p, m, peaks)


def test_evaluation_runs_forwards_only():
    for p, v in [(2, 1), (3, 2), (4, 2)]:
        actions = evaluation_schedule(p, v)
        assert all(a.kind in (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)
                   for acts in actions for a in acts)
        simulate(actions, virtual_stages=v)


def test_the_simulator_finds_a_deadlock_and_marks_it():
    # both ranks wait for the other's activation before doing anything
    actions = [[Action(Kind.RECV_GRAD, 0, 0, 1), Action(Kind.FORWARD, 0)],
               [Action(Kind.RECV_ACT, 0, 0, 0), Action(Kind.FORWARD, 0)]]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(actions)
    assert ">>rg0@1<<" in str(err.value) and ">>ra0@0<<" in str(err.value)


def test_the_simulator_finds_a_send_nobody_receives():
    actions = [[Action(Kind.FORWARD, 0), Action(Kind.SEND_ACT, 0, 0, 1)],
               [Action(Kind.FORWARD, 0)]]
    with pytest.raises(ScheduleError, match="never received"):
        simulate(actions)


def test_the_simulator_refuses_a_backward_before_its_forward():
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate([[Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 0)]])
    with pytest.raises(ScheduleError, match="before its backward"):
        simulate([[Action(Kind.FORWARD, 0), Action(Kind.BACKWARD_WEIGHT, 0),
                   Action(Kind.BACKWARD, 0)]])


def test_timeline_of_gpipe_by_hand():
    timeline = simulate(build_schedule("gpipe", 2, 2))
    starts = sorted((b.rank, b.kind.value, b.microbatch, b.start) for b in timeline.blocks)
    assert starts == [(0, "backward", 0, 4.0), (0, "backward", 1, 5.0), (0, "forward", 0, 0.0),
                      (0, "forward", 1, 1.0), (1, "backward", 0, 3.0), (1, "backward", 1, 4.0),
                      (1, "forward", 0, 1.0), (1, "forward", 1, 2.0)]
    assert timeline.makespan == 6.0 and timeline.bubble == pytest.approx(1 / 3)


# ---- partition -------------------------------------------------------------------------------
def test_balanced_cuts_minimise_the_heaviest_stage():
    assert balanced_cuts([4, 1, 1, 1, 1, 4], 3) == [0, 1, 5, 6]
    assert balanced_cuts([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert balanced_cuts([3, 2, 2, 3], 2) == [0, 2, 4]


def test_explicit_cut_points():
    model = eq.tied_pipe()
    assert stage_bounds(model, mt.Plan(pp=2), [3]) == [0, 3, 8]
    with pytest.raises(PlanError, match="increasing layer indices"):
        stage_bounds(model, mt.Plan(pp=2), [9])
    with pytest.raises(PlanError, match="give 3 increasing"):
        stage_bounds(model, mt.Plan(pp=4), [2, 4])


def test_gpt_stages_split_its_layers():
    bounds = stage_bounds(eq.gpt_pipe(), mt.Plan(pp=4))
    assert bounds[0] == 0 and bounds[-1] == 8 and len(bounds) == 5


# ---- bad input: refused with a clear message before any process group ---------------------
def _trainer(model, plan):
    return mt.Trainer(model, plan, optimizer=eq.sgd, loss_fn=eq.token_loss)


def test_more_stages_than_layers():
    with pytest.raises(PlanError, match=r"8 stages, but Sequential has only 6 layers"):
        _trainer(eq.tied_sequential(), mt.Plan(pp=4, schedule="interleaved", microbatches=4,
                                               virtual_stages=2))
    assert not torch.distributed.is_initialized()


def test_a_model_exposing_no_layers():
    with pytest.raises(PlanError, match="WithExtras exposes no layers: pass an nn.Sequential"):
        _trainer(eq.WithExtras(), mt.Plan(pp=2))


def test_parameters_outside_the_layers():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

        def layers(self):
            return [self.a, self.b]

    with pytest.raises(PlanError, match=r"\['scale'\] belong to none of them"):
        check(Odd(), mt.Plan(pp=2))


def test_interleaved_needs_microbatches_a_multiple_of_pp():
    with pytest.raises(PlanError, match="microbatches=6 must be a multiple of pp=4"):
        mt.Plan(pp=4, schedule="interleaved", microbatches=6, virtual_stages=2)


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(PlanError, match="virtual_stages=2 needs schedule='interleaved'"):
        mt.Plan(pp=2, schedule="1f1b", virtual_stages=2)


def test_microbatches_that_do_not_divide_the_batch():
    from meshtrain.strategies.slots import split_microbatches
    with pytest.raises(PlanError, match="batch of 10 does not split into microbatches=4"):
        split_microbatches(torch.zeros(10, 3), 4)


def test_stage_cuts_without_pipeline():
    with pytest.raises(PlanError, match="stage_cuts is given but Plan.pp=1"):
        _trainer(eq.tied_pipe(), mt.Plan(stage_cuts=[2]))


def test_compute_orders_never_mention_a_chunk_beyond_v():
    for schedule, p, m, v in CASES:
        for order in compute_order(schedule, p, m, v):
            assert all(0 <= c < v and 0 <= i < m and k in COMPUTE for k, i, c in order)


# ---- meshtrain schedule ----------------------------------------------------------------------
def test_schedule_command_prints_the_timeline_and_the_bubble(tmp_path, capsys):
    from meshtrain.cli.main import main

    out = tmp_path / "t.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
                 "--virtual-stages", "2", "--backward-cost", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bubble        0.1579 simulated, (P-1)/(V*M+P-1) = 0.1579" in text
    assert text.count("rank ") == 4 and "F7.1" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_command_refuses_a_bad_plan(capsys):
    from meshtrain.cli.main import main

    assert main(["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                 "--virtual-stages", "2"]) == 2
    assert "must be a multiple of pp=4" in capsys.readouterr().err
