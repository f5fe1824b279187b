"""Three defects found by reading the planner against the runtime, each fixed: the output
layer's activations live on the last pipeline stage; ZeRO-3 on one data-parallel rank without
offload saves nothing; a layer too big for one device can also be offloaded."""
import pytest

from meshtrain.core.plan import Plan
from meshtrain.planner import Setup, advise, make_cluster, preset
from meshtrain.planner import activations as am
from meshtrain.planner import memory as mm
from meshtrain.planner import states as sm
from meshtrain.planner.guide import FAMILIES, questions
from meshtrain.planner.setup import Candidate
from meshtrain.planner.stage_split import stage_blocks

SETUP = Setup(global_batch=16, precision="bf16")


def test_the_output_layer_lives_on_the_last_stage():
    spec = preset("gpt2-350m")
    cand = Candidate(Plan(pp=2, microbatches=8, schedule="1f1b"), 2, "none")
    first, last = mm.stage_memories(spec, cand, SETUP)
    per_layer = am.layer_activation_bytes(spec, spec.seq, 2, elem_bytes=SETUP.act_bytes)
    split = stage_blocks(spec, cand.plan)   # balanced by compute: the head's stage has fewer
    assert sum(split) == spec.layers and split[0] > split[1]
    output = (2 * SETUP.act_bytes * spec.seq * 2 * spec.hidden
              + am.logits_bytes(spec, spec.seq, 2, 1))
    # 1F1B: the first stage holds p = 2 micro-batches of its blocks and no output layer,
    # the last one micro-batch of its blocks and the output layer's activations and logits
    assert first.activations == pytest.approx(2 * split[0] * per_layer)
    assert last.activations == pytest.approx(split[1] * per_layer + output)
    assert first.params == pytest.approx(sm.stage_params(spec, cand.plan, 0) * SETUP.param_bytes)
    assert last.params == pytest.approx(sm.stage_params(spec, cand.plan, 1) * SETUP.param_bytes)
    # the busiest rank is whichever stage needs more, with its own parameters
    assert mm.memory(spec, cand, SETUP).total == max(first.total, last.total)


@pytest.mark.parametrize("schedule, v, expected", [
    ("gpipe", 1, [8, 8, 8, 8]), ("1f1b", 1, [4, 3, 2, 1]),
    # Megatron's interleaved warm-up 2(p - s - 1) + (v - 1) p chunk-forwards, +1, over v
    ("interleaved", 2, [(6 + 4 + 1) / 2, (4 + 4 + 1) / 2, (2 + 4 + 1) / 2, (0 + 4 + 1) / 2]),
])
def test_microbatches_in_flight_per_stage(schedule, v, expected):
    got = [am.inflight_microbatches(schedule, 4, 8, v, stage) for stage in range(4)]
    assert got == expected
    assert got[0] == am.inflight_microbatches(schedule, 4, 8, v)   # the first stage's


def test_zero3_on_one_rank_is_ranked_only_with_offload():
    advice = advise(preset("gpt2-124m"), Setup(global_batch=8), make_cluster("A100-80GB",
                                                                              gpus_per_node=1))
    ranked = [ev.cand.plan for ev in advice.ranked + advice.rejected]
    assert ranked, "the model fits one device"
    assert not [p for p in ranked if p.zero == 3 and p.dp == 1 and p.offload == "none"]


def test_a_layer_too_big_for_a_device_may_be_offloaded():
    # the guide: largest layer does not fit -> tensor parallel, ZeRO-3 ... or offload its
    # gradient and optimizer state to host memory
    words, is_family = FAMILIES["big-layer"]
    assert "offload" in words
    assert is_family(Plan(dp=8, zero=1, offload="cpu"))
    spec = preset("gpt3-175b")
    cluster = make_cluster("A100-80GB", gpus_per_node=8, gpu_mem="8GB")
    qs, family = questions(advise(spec, SETUP, cluster))
    assert family == "big-layer"
    assert qs[1].question == "Does its largest layer fit on one device?" and not qs[1].answer
