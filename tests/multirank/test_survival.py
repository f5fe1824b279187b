"""A rank killed with kill -9 (at a step, or while it writes a checkpoint) under
`meshtrain train --max-restarts 1`: the group restarts, resumes from the latest complete
checkpoint and ends bit-equal to the uninterrupted run. Without restarts, the run stops and
names the rank that died. (`meshtrain bench survival --runs 10` runs 10 of each kind.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.bench import survival
from meshtrain.train import faults
from meshtrain.train.run import _record_step


def test_a_killed_rank_restarts_and_ends_bit_equal(tmp_path):
    outcomes = survival.run_cases([("ddp", "1:3"), ("zero2", "0:4:checkpoint")], tmp_path)
    for o in outcomes:
        assert o.exit_code == 0, o.log
        assert o.bit_equal, f"{o.plan} killed at {o.fault}: final parameters differ"
    # checkpoints every 2 steps: killed in step 3 -> resumed at 2; killed while writing the
    # checkpoint of step 4 -> that one is incomplete, resumed at 2
    assert [o.resumed_from for o in outcomes] == [2, 2]
    ddp_run = tmp_path / "ddp-0"
    summary = json.loads((ddp_run / "summary.json").read_text())
    assert summary["restarts"] == 1
    steps = [json.loads(line)["step"] for line in (ddp_run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, survival.STEPS + 1))   # the redone steps are not doubled
    assert sorted(p.name for p in (ddp_run / "checkpoints").iterdir()) == [
        "latest", "step_00000004", "step_00000006"]


def test_without_restarts_the_dead_rank_is_named_in_one_line(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(Path(survival.__file__).read_text() * 8)
    env = dict(os.environ, MESHTRAIN_INJECT_FAULT="1:3")
    cmd = [str(Path(sys.executable).parent / "meshtrain"), "train", "--nproc", "2",
           "--data", str(data), "--steps", "6", "--ckpt-every", "2", "--run-dir",
           str(tmp_path / "run"), *survival.SHAPE]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "rank 1 died without an error of its own" in done.stderr
    assert "Traceback (most recent call last)" not in done.stderr
    assert "rank 1 failed (signal SIGKILL)" in (tmp_path / "run" / "failure.log").read_text()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.parametrize("text", ["1", "a:2", "1:2:later", "1:2:3:4"])
def test_a_malformed_fault_is_refused(text):
    with pytest.raises(ValueError, match="RANK:STEP"):
        faults.parse(text)


def test_a_half_written_metrics_line_is_dropped_on_resume():
    assert _record_step('{"step": 3, "loss": 1.0}') == 3
    assert _record_step('{"step": 4, "lo') == float("inf")
