"""The measured timeline against theory, and the trace files.

A model whose layers take a fixed time (models/spin.py: F = B = W = 25 ms per stage, one
layer per stage or chunk) runs each schedule for 4 steps on P local ranks; the median step's
measured bubble must lie within the schedule's own bound of the formula's (equal stage
costs), and zb-h1's below 1F1B's on the same run. Theory counts communication and the
host's work between blocks as free. The bound is what the same schedule loses when they are
not: the simulator run with every message costing MESSAGE_S and every compute block
followed by HOST_S of host work, minus theory. Local ranks sharing a few cores measured
0.3-2 ms a message and 0.5-1.2 ms of host work a block; a schedule whose critical path waits
on more messages (1F1B's steady state, interleaving's 2V hops) gets a wider bound, GPipe's
stream of forwards a narrow one. A layer takes 25 ms so that those costs stay small beside it.
The layers sleep rather than spin, so that a loaded machine does not stretch one rank's
compute against another's; and so P = 2 and P = 4 are measured side by side, in one `alone`
slot instead of two (their six ranks use a few percent of the cores). A miss is measured
again alone, on fresh ranks."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshtrain.bench.pipeline import documents, measure_rank, median_step
from meshtrain.report.trace import SCHEMA, chrome_trace, save_trace
from meshtrain.strategies.pipeline.schedules import bubble_formula, build_schedule
from meshtrain.strategies.pipeline.simulator import simulate
from meshtrain.testing import run_ranks

SECONDS = 0.025
MESSAGE_S = 0.002   # the most a message between local ranks was measured to cost
HOST_S = 0.002      # host work between two blocks: about 1 ms measured, doubled for a margin
CASES = [(s, m, 2 if s == "interleaved" else 1)
         for s in ("gpipe", "1f1b", "interleaved", "zb-h1") for m in (4, 8)]
WORLDS = (2, 4)


def _run(p: int) -> list:
    return run_ranks(p, measure_rank, CASES, SECONDS, 4, timeout=300)


def _medians(results: list) -> dict:
    return {case: median_step(docs) for case, docs in zip(CASES, documents(results, CASES))}


@pytest.fixture(scope="module")
def measured():
    cache = {}

    def get(p, again=False):
        if again:   # this world alone, on fresh ranks
            cache[p] = _medians(_run(p))
        elif p not in cache:   # every world not yet measured, side by side
            todo = [w for w in WORLDS if w not in cache]
            # each world's results are read once both are done: nothing computes beside one
            with ThreadPoolExecutor(len(todo)) as pool:
                runs = list(pool.map(_run, todo))
            cache.update((w, _medians(results)) for w, results in zip(todo, runs))
        return cache[p]
    return get


def bound(schedule: str, p: int, m: int, v: int) -> float:
    """How far the schedule's bubble moves from theory's when messages and the host's work
    between blocks cost what they were measured to (MESSAGE_S, HOST_S)."""
    costs = dict(forward_cost=SECONDS, backward_cost=2 * SECONDS, weight_cost=SECONDS,
                 virtual_stages=v)
    actions = build_schedule(schedule, p, m, v)
    return (simulate(actions, **costs, message_cost=MESSAGE_S, host_cost=HOST_S).bubble
            - simulate(actions, **costs).bubble)


def _off_theory(docs: dict, p: int) -> list[str]:
    """The cases whose measured bubble lies outside theory's (F = B = W) give or take the
    schedule's bound."""
    off = []
    for (schedule, m, v), doc in docs.items():
        theory, formula = bubble_formula(schedule, p, m, v, 1.0, 2.0, 1.0)
        got, allowed = doc["measured"]["bubble"], bound(schedule, p, m, v)
        if abs(got - theory) >= allowed:
            off.append(f"{schedule} P={p} M={m}: measured {got:.3f}, {formula} = {theory:.3f}"
                       f" (bound {allowed:.3f})")
    return off


def test_the_bound_grows_with_the_messages_on_the_critical_path():
    """GPipe's forwards stream through the ranks and hide most message costs; 1F1B's
    steady state waits on one message per block; interleaving doubles the hops."""
    for p, m in ((2, 8), (4, 8)):
        assert 0 < bound("gpipe", p, m, 1) < bound("1f1b", p, m, 1) < bound("interleaved", p, m, 2)


@pytest.mark.alone
@pytest.mark.parametrize("p", WORLDS)
def test_measured_bubble_lies_within_the_schedules_bound_of_theory(measured, p):
    """A wall-clock timeline: a process outside the suite that wakes while it is measured
    stretches its messages (a case measured 0.06 over theory once in CI, 0.01-0.03 in every
    other run). Where a case misses, the whole world is measured once more on fresh ranks
    and held to the same bound; a schedule that is wrong misses both times."""
    off = _off_theory(measured(p), p)
    if off:
        again = _off_theory(measured(p, again=True), p)
        assert not again, f"first measurement: {off}; again: {again}"
    docs = measured(p)
    for m in (4, 8):
        assert (docs[("zb-h1", m, 1)]["measured"]["bubble"]
                < docs[("1f1b", m, 1)]["measured"]["bubble"])


def test_trace_files_load_with_every_ranks_events(measured, tmp_path):
    p = 2
    for (schedule, m, v), doc in measured(p).items():
        paths = save_trace(doc, tmp_path, f"{schedule}-{m}")
        loaded = json.loads(paths["json"].read_text())
        assert loaded["schema"] == SCHEMA and loaded["schedule"] == schedule
        assert (loaded["pp"], loaded["microbatches"], loaded["virtual_stages"]) == (p, m, v)
        assert set(loaded["measured"]) == {"bubble", "makespan_s"}
        assert {"bubble", "formula", "formula_bubble", "costs_s"} <= set(loaded["theory"])
        per_action = 3 if schedule == "zb-h1" else 2   # F, B (and W)
        for r in loaded["ranks"]:
            assert len(r["blocks"]) == per_action * m * v
            for b in r["blocks"] + r["waits"]:
                assert set(b) == {"kind", "microbatch", "chunk", "start", "end"}
                assert 0 <= b["start"] <= b["end"]
        chrome = json.loads(paths["chrome"].read_text())
        assert chrome == json.loads(json.dumps(chrome_trace(loaded)))
        spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)
        for rank in range(p):
            compute = [e for e in spans if e["pid"] == rank and e["tid"] == 0]
            assert len(compute) == per_action * m * v
            assert {e["name"][0] for e in compute} == ({"F", "B", "W"} if per_action == 3
                                                       else {"F", "B"})
        assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the commands ------------------------------------------------------------------------------
def _meshtrain(*args, timeout=180):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([str(Path(sys.executable).parent / "meshtrain"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_train_trace_saves_the_last_steps_timeline(tmp_path):
    run = tmp_path / "run"
    out = _meshtrain("train", "--nproc", "2", "--pp", "2", "--microbatches", "4", "--schedule",
                     "zb-h1", "--steps", "2", "--trace", "--run-dir", str(run), "--layers", "2",
                     "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "8",
                     "--no-progress", "--eval-every", "5", "--ckpt-every", "5")
    assert out.returncode == 0, out.stderr
    assert "trace of step 2: measured bubble" in out.stderr
    doc = json.loads((run / "trace.json").read_text())
    assert (doc["schedule"], doc["pp"], doc["step"]) == ("zb-h1", 2, 2)
    chrome = json.loads((run / "trace.chrome.json").read_text())
    for rank in range(2):
        compute = [e for e in chrome["traceEvents"]
                   if e["ph"] == "X" and e["pid"] == rank and e["tid"] == 0]
        assert len(compute) == 3 * 4
    assert (run / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_trace_needs_a_pipeline(tmp_path, capsys):
    from meshtrain.cli.main import main   # refused before any rank: in this process

    code = main(["train", "--nproc", "2", "--trace", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and "--trace records a pipeline's timeline" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_schedule_measure_draws_measured_beside_theory(tmp_path):
    out = _meshtrain("schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1",
                     "--measure", "--unit-ms", "5", "--steps", "2", "--out",
                     str(tmp_path / "zb.png"))
    assert out.returncode == 0, out.stderr
    assert "(P-1)(F+B-W)/(M(F+B+W)+(P-1)(F+B-W))" in out.stdout
    assert "measured      bubble" in out.stdout
    for name in ("zb.png", "zb-measured.png", "zb-measured.json", "zb-measured.chrome.json"):
        assert (tmp_path / name).exists(), name


def test_bench_pp_runs_ours_against_torch_pipelining(tmp_path):
    out = _meshtrain("bench", "pp", "--world", "2", "--microbatches", "4", "--steps", "1",
                     "--reps", "1", "--warmup", "1", "--batch", "8", "--model", "tiny",
                     "--json", str(tmp_path / "pp.json"), timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "pp.json").read_text())["worlds"]["2"]
    assert set(rows) == {"gpipe M=4 V=1", "1f1b M=4 V=1", "interleaved M=4 V=2",
                         "zb-h1 M=4 V=1"}
    assert all(r["meshtrain_s"] > 0 and r["torch_s"] > 0 for r in rows.values())
    assert "ScheduleInterleavedZeroBubble" in out.stdout
