"""The bytes ZeRO-2 sends over dp under pipeline stages (planner/traffic.py): it reduce-scatters
every micro-batch there too (strategies/zero/sharded.py, a round is a micro-batch; under
interleaved stages each round reaches one chunk, so each chunk is reduced m times), then
all-gathers the parameters once. `meshtrain plan --verify` counted it on dp=2 x pp=2
interleaved (V=2, 4 micro-batches): 4 reduce-scatters of the stage's gradients and one
all-gather a step, where the planner had priced ZeRO-3's kept policy (once a step). Expected
values are written from that policy, never computed by the function under test."""
import pytest

from meshtrain.core.plan import Plan
from meshtrain.planner import from_description
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.states import stage_params
from meshtrain.planner.traffic import axis_bytes

SPEC = from_description(8, 1024, 16, 32000, 2048)
SETUP = Setup(global_batch=32)
INTERLEAVED = dict(schedule="interleaved", virtual_stages=2)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("schedule", [{}, INTERLEAVED])
def test_zero2_under_stages_reduce_scatters_every_micro_batch(m, schedule):
    plan = Plan(dp=2, pp=2, zero=2, microbatches=m, **schedule)
    for stage in (0, 1):
        psi = stage_params(SPEC, plan, stage)
        # ring halves over dp 2: m reduce-scatters of the gradients, one all-gather
        expected = (m * psi * SETUP.grad_bytes + psi * SETUP.param_bytes) / 2
        assert axis_bytes(SPEC, Candidate(plan, 1, "none"), SETUP, stage)["dp"] == \
            pytest.approx(expected)


def test_zero1_under_stages_still_reduces_once_a_step():
    plan = Plan(dp=2, pp=2, zero=1, microbatches=4, **INTERLEAVED)
    psi = stage_params(SPEC, plan, 0)
    assert axis_bytes(SPEC, Candidate(plan, 1, "none"), SETUP, 0)["dp"] == \
        pytest.approx(psi * (SETUP.grad_bytes + SETUP.param_bytes) / 2)
