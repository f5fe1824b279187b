"""`meshtrain plan --verify` machinery on a tiny GPT: 2 DDP plans (world 1 and 2), a
tensor-parallel one (tp 2), two pipeline stages and a parameter server (whose ranks differ,
so each is reported per role), tensor parallel with sequence parallel, DiLoCo syncing every
2 steps (measured over whole rounds), GPipe's two stages, real ranks.

Model-state bytes, the allocated peak (the allocator's own events) and the bytes sent are
asserted against the planner: the bytes sent exactly but for the step's statistics, the
peak within 3% (below the +13% / +14% misses the planner once had; tensor parallel's buffers
in flight let its measured peak rise up to 15% above); step time and resident memory depend
on the machine and its load, so they are only checked to be measured (speed lives in
benchmarks)."""
import io
import time

import pytest

from meshtrain.measure import verify
from tests.synthetic_profile import synthetic_profile

TINY = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32)
PLANS = (({"dp": 1}, 4), ({"dp": 2, "microbatches": 2}, 4), ({"tp": 2}, 4),
         ({"pp": 2, "microbatches": 2}, 4), ({"dp": 2, "dp_mode": "ps-sync"}, 4),
         ({"tp": 2, "sequence_parallel": True}, 4),
         ({"dp": 2, "dp_mode": "diloco", "sync_every": 2}, 4),
         ({"pp": 2, "microbatches": 2, "schedule": "gpipe"}, 4))

PROFILE = synthetic_profile(worlds=("1", "2"))


@pytest.fixture(scope="module")
def rows_and_text():
    out = io.StringIO()
    start = time.perf_counter()
    rows = verify.verify(PROFILE, plans=PLANS, steps=2, warmup=1, model=TINY, out=out, rounds=2)
    print(f"\nverify of {len(PLANS)} tiny plans: {time.perf_counter() - start:.1f} s")
    return rows, out.getvalue()


def test_model_states_predicted_equal_the_trainers_accounting(rows_and_text):
    rows, _ = rows_and_text
    assert [r["world"] for r in rows] == [1, 2, 2, 2, 2, 2, 2, 2]
    for r in [r for row in rows for r in (row, *row.get("roles", ()))]:
        # the planner counts the GPT's parameters exactly: 4 + 4 (bucket) + 8 (AdamW) bytes
        # each; it leaves out only AdamW's 4-byte step counter per parameter tensor, and
        # DiLoCo's sync buffer's 4 bytes per tensor (which it used) and of the loss
        measured = r["measured"]["model_states"]
        scalars = 2 if r["plan"].startswith("dp=2, dp_mode='diloco'") else 1
        assert 0 <= measured - r["predicted"]["model_states"] <= scalars * 4 * 64  # < 63 tensors
        assert abs(r["error"]["model_states"]) <= verify.LIMITS["model_states"]


# The allocated peak: states + saved activations + backward's transients, against the
# allocator's events. Without tensor parallel it is deterministic, and measured within 2.0%
# on every such plan (the few small tensors the model does not name: index tensors, the
# loss, the statistics): held to 3% both ways, below the +13% / +14% misses the planner
# had (test_recompute_peak_measured.py, test_zero3.py). Under tensor parallel the peak also
# holds the collectives' buffers still in flight when it falls, which depends on when each
# rank's sends complete (-11% to +2% over four runs, tp 2 with and without sequence
# parallel; +3.1% for tp 2 with sequence parallel in one suite run on a loaded machine):
# held to 5% above, and below only to the old 15%.
PEAK_REL, IN_FLIGHT_REL, IN_FLIGHT_ABOVE = 0.03, 0.15, 0.05


def test_allocated_peak_is_the_derived_tensors(rows_and_text):
    rows, _ = rows_and_text
    assert any(plan.get("pp", 1) > 1 for plan, _ in verify.PLANS)   # the tool's own, too
    for r in [r for row in rows for r in (row, *row.get("roles", ()))]:
        predicted, measured = r["predicted"]["peak_alloc"], r["measured"]["peak_alloc"]
        assert measured >= r["measured"]["model_states"]
        tp = r["plan"].startswith("tp=")
        below, above = (IN_FLIGHT_REL, IN_FLIGHT_ABOVE) if tp else (PEAK_REL, PEAK_REL)
        assert measured * (1 - below) <= predicted <= measured * (1 + above), r["plan"]


def test_time_and_resident_memory_are_measured(rows_and_text):
    rows, _ = rows_and_text
    for r in rows:
        for key in ("step", "peak_rss", "activations"):
            assert r["measured"][key] > 0 and r["predicted"][key] > 0, key
        # each plan ran once per round; the quoted values are the rounds' medians
        for key in ("step", "peak_rss"):
            assert len(r["rounds"][key]) == 2
            assert r["measured"][key] == pytest.approx(sum(r["rounds"][key]) / 2)


def test_report_has_predicted_and_measured_columns(rows_and_text):
    rows, text = rows_and_text
    lines = text.strip().splitlines()
    every = [r for row in rows for r in (row, *[{**sub, "plan": f"  - {sub['plan']}"}
                                                for sub in row.get("roles", ())])]
    assert len(lines) == len(every)
    for r, line in zip(every, lines):
        assert line.startswith(r["plan"])
        for key, _, scale in verify.COLUMNS:
            assert f"{r['predicted'][key] / scale:7.2f} /{r['measured'][key] / scale:7.2f}" in line
    assert "pred / meas" in verify.HEADER and "peak RSS MB" in verify.HEADER
    ok, summary = verify.summary(rows)
    assert "model_states: worst error" in summary


def test_bytes_sent_per_axis_equal_the_comm_counters(rows_and_text):
    """Exact counters against ring theory. The planner leaves out only the step's
    statistics: DDP's payload of 1 + one element per parameter tensor in the last bucket
    (fp32, a ring sends each element at most twice), the loss a last stage broadcasts."""
    from meshtrain.models.gpt import GPT, GPTConfig

    statistics = 2 * 4 * (1 + len(list(GPT(GPTConfig(**TINY)).parameters())))
    rows, _ = rows_and_text
    axes = {}
    for r in [r for row in rows for r in (row, *row.get("roles", ()))]:
        predicted, measured = r["sent_by_axis"]["predicted"], r["sent_by_axis"]["measured"]
        for axis in ("dp", "tp", "pp"):
            assert 0 <= measured[axis] - predicted[axis] <= statistics, (r["plan"], axis)
            axes[axis] = axes.get(axis, 0) + measured[axis]
    assert all(axes[a] > 0 for a in ("dp", "tp", "pp"))   # every axis was exercised


def test_ranks_that_differ_are_reported_per_role(rows_and_text):
    rows, _ = rows_and_text
    plain, pipeline, server = rows[1], rows[3], rows[4]
    assert "roles" not in plain
    assert [r["plan"] for r in pipeline["roles"]] == ["stage 0", "stage 1"]
    assert [r["plan"] for r in server["roles"]] == ["server", "worker"]
    # the root holds the master copy, the summed pushes and the optimizer on top of a
    # worker's parameters and bucket: 4 + 4 + 8 more bytes per parameter (fp32, AdamW)
    root, worker = (r["measured"]["model_states"] for r in server["roles"])
    assert root == pytest.approx(3 * worker, rel=0.01)
    assert server["measured"]["model_states"] == root
    for row in (pipeline, server):   # the plan's row: the most any role needs, both sides
        for key in ("model_states", "activations", "peak_alloc", "peak_rss"):
            assert row["predicted"][key] == max(r["predicted"][key] for r in row["roles"])
        for key in ("model_states", "activations", "peak_alloc"):   # exact: the first round's
            assert row["measured"][key] == max(r["measured"][key] for r in row["roles"])
        # the resident peak is the rounds' median of the highest rank: in each round the
        # highest role's (which role that is may change from round to round)
        for i, peak in enumerate(row["rounds"]["peak_rss"]):
            assert peak == max(r["rounds"]["peak_rss"][i] for r in row["roles"]), i


def test_diloco_is_measured_over_whole_rounds(rows_and_text):
    """Two steps hold one sync of the parameters, as large as DDP's gradients: per step half
    of DDP's bytes, counted over the round (one step alone would count a sync or none), and
    the states DDP's plus three parameter-sized buffers (anchor, outer momentum, sync
    buffer), both sides."""
    rows, _ = rows_and_text
    ddp, diloco = rows[1], rows[6]
    assert diloco["measured"]["sent"] == pytest.approx(ddp["measured"]["sent"] / 2, rel=0.01)
    params = ddp["measured"]["model_states"] / 16   # fp32 parameters, gradients, AdamW's 2
    for side in ("predicted", "measured"):
        extra = diloco[side]["model_states"] - ddp[side]["model_states"]
        assert extra == pytest.approx(3 * 4 * params, rel=0.01), side


def test_sequence_parallel_activations_are_korthikantis(rows_and_text):
    """meshtrain's sequence parallel saves the column-parallel layers' input slices and
    gathers them again in backward (Megatron-LM, Korthikanti's 34/t): the planner's count
    is the Trainer's."""
    rows, _ = rows_and_text
    tp, sp = rows[2], rows[5]
    assert sp["predicted"]["activations"] == pytest.approx(sp["measured"]["activations"], rel=0.03)
    assert sp["measured"]["activations"] < tp["measured"]["activations"]   # all 34 split


def test_gpipes_last_stage_holds_every_micro_batchs_output_layer(rows_and_text):
    """GPipe runs every forward, the loss's too, before any backward: its last stage keeps
    the output layer's inputs and the loss's logits for each micro-batch (1F1B's, one)."""
    rows, _ = rows_and_text
    for row in (rows[3], rows[7]):
        for stage in row["roles"]:
            assert stage["predicted"]["activations"] == pytest.approx(
                stage["measured"]["activations"], rel=0.03), (row["plan"], stage["plan"])


def test_calibration_ranks_agree_on_repetitions_and_measure_every_collective():
    from meshtrain.measure.probe import measure_rank
    from meshtrain.measure.runs import KINDS, MIN_REPS
    from meshtrain.testing import run_ranks

    sizes = (256, 4096)
    results = run_ranks(2, measure_rank, sizes, 0.01, timeout=120)
    # the ranks must run the same collectives the same number of times, or they would hang
    assert results[0]["reps"] == results[1]["reps"] >= MIN_REPS
    for r in results:
        assert set(r["collectives"]) == set(KINDS)
        for curve in r["collectives"].values():
            assert curve["sizes"] == list(sizes) and all(b > 0 for b in curve["busbw"])
        assert r["model_flops"] > 0 and r["optimizer_rate"] > 0 and r["mem_bw"] > 0


def test_a_transformers_model_verifies_and_a_plan_it_cannot_run_is_refused_not_fatal():
    """`--verify --model llama-tiny`: the transformers model trains under verify's plans and
    the planner judges it by its config; a plan with more stages than the model has
    layers is refused by the Trainer on its ranks, reported, and the other plans still run.
    What its layers save is traced (measure/traced.py), and ZeRO-3 gathers its decoder layers twice
    but the last, and all outside them once: both as measured."""
    from meshtrain.measure.trained_model import TrainedModel, spec_of

    model, out, failed = TrainedModel("llama-tiny", 32), io.StringIO(), []
    plans = (({"dp": 1}, 2), ({"pp": 2, "schedule": "interleaved", "virtual_stages": 4,
                               "microbatches": 2}, 2),
             ({"dp": 2, "zero": 3}, 2))
    rows = verify.verify(PROFILE, plans=plans, steps=1, warmup=1, rounds=2, out=out,
                         model=model, failed=failed)
    assert [r["plan"] for r in rows] == [verify.label(*plans[0]), verify.label(*plans[2])]
    assert [(name, refused) for name, refused, _ in failed] == [(verify.label(*plans[1]), True)]
    assert "8 stages" in failed[0][2] and "refused" in out.getvalue()
    # the planner's model states are the built model's exact count: 4 + 4 + 8 bytes each
    params = spec_of(model).num_params
    assert rows[0]["predicted"]["model_states"] == 16 * params
    assert 0 <= rows[0]["measured"]["model_states"] - 16 * params <= 4 * 64
    assert abs(rows[0]["error"]["activations"]) < 0.02   # RoPE's tables, once per batch
    assert abs(rows[1]["error"]["sent"]) < 0.001
