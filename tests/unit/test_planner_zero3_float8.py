"""The planner's pricing of ZeRO-3's float8 all-gather (strategies/zero/float8_gather.py):
under fp8's tensorwise scaling the block linears' weights cross the all-gather, and sit in
the gathered unit, at 1 byte an element where bf16 takes 2; rowwise, or
zero3_fp8_gather=False, keeps bf16's. Expected values written by hand from the shapes."""
import pytest

from meshtrain.core.plan import Plan
from meshtrain.planner.memory import stage_memories
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.traffic import axis_bytes
from tests.unit.test_planner_fp8 import SPEC, H, KV, F, L

SETUP = Setup(global_batch=16, micro_batch=2, precision="fp8")
# q, o (h x h), k, v (h x kv) and the SwiGLU's three h x f matrices of one block
FLOAT8_LAYER = 2 * H * H + 2 * H * KV + 3 * H * F


def _cand(**plan) -> Candidate:
    return Candidate(Plan(precision="fp8", zero=3, **plan), 2, "none")


@pytest.mark.parametrize("m", [1, 4])
def test_zero3_gathers_the_block_linears_weights_at_one_byte(m):
    """Per micro-batch two all-gathers (forward, backward) of every block, each sending
    (N-1)/N of it: a byte saved per float8 weight element in each."""
    share = 7 / 8
    out = {g: axis_bytes(SPEC, _cand(dp=8, microbatches=m, zero3_fp8_gather=g), SETUP)["dp"]
           for g in (None, False)}
    assert out[False] - out[None] == pytest.approx(m * share * 2 * L * FLOAT8_LAYER)
    rowwise = axis_bytes(SPEC, _cand(dp=8, microbatches=m, fp8_recipe="rowwise"), SETUP)
    assert rowwise["dp"] == pytest.approx(out[False])   # no float8 all-gather for rowwise


def test_under_stages_each_stage_gathers_its_own_blocks_once():
    share, plan = 3 / 4, dict(dp=4, pp=2, microbatches=4)
    for stage in range(2):   # 2 blocks a stage
        out = {g: axis_bytes(SPEC, _cand(**plan, zero3_fp8_gather=g), SETUP, stage)["dp"]
               for g in (None, False)}
        assert out[False] - out[None] == pytest.approx(share * 2 * FLOAT8_LAYER)


def test_the_gathered_units_hold_the_float8_weights_at_one_byte():
    # pp = 1: the unit computing and the one prefetched, each the largest, a block
    # (its linears, 2 norms: larger than the 1024 x 512 embedding or head)
    mems = {g: stage_memories(SPEC, _cand(dp=8, zero3_fp8_gather=g), SETUP)[0]
            for g in (None, False)}
    assert mems[False].buffers - mems[None].buffers == pytest.approx(2 * FLOAT8_LAYER)
    # under stages: the stage's units all gathered, kept to its last backward
    plan = dict(dp=4, pp=2, microbatches=4)
    kept = {g: stage_memories(SPEC, _cand(**plan, zero3_fp8_gather=g), SETUP)
            for g in (None, False)}
    for stage in range(2):
        saved = kept[False][stage].buffers - kept[None][stage].buffers
        assert saved == pytest.approx(2 * FLOAT8_LAYER)
