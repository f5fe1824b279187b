"""`meshtrain train` end to end: torchrun across two node agents, resume (also of a copied
run folder), a crafted checkpoint refused in one line (bad input: tests/unit/test_bad_input.py)."""
import json
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "8",
         "--no-progress", "--eval-every", "3", "--ckpt-every", "3"]
BIN = Path(sys.executable).parent


def meshtrain(*args, timeout=120, cwd=None):
    return subprocess.run([str(BIN / "meshtrain"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> list[tuple]:
    return [(m["step"], round(m.get("loss", m.get("val_loss")), 5)) for m in metrics(run_dir)]


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999). Every other test's store
    binds port 0, which the kernel answers from that range: a port found that way and
    closed could be handed to another test before torchrun binds it (one CI run's agents
    failed with "the connection to the C10d store has failed")."""
    for port in random.Random().sample(range(20000, 32768), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    out = meshtrain("train", "--nproc", "1", "--steps", "6", "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    return run


def test_two_node_agents_under_torchrun_match_one_process(one_process, tmp_path):
    run, port = tmp_path / "run", free_port()
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "-m", "meshtrain", "train", "--steps", "6", "--run-dir", str(run), *SMALL]
    nodes = [subprocess.Popen(cmd[:1] + ["--node-rank", str(k)] + cmd[1:], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in range(2)]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "Plan(dp=2)" in outs[0][0] + outs[1][0]
    assert losses(run) == losses(one_process)


def test_3d_plan_over_two_node_agents_under_torchrun_matches_one_process(one_process,
                                                                         tmp_path):
    """dp 2 x pp 2 x tp 2 + ZeRO-1 on 2 nodes x 4 ranks: each tp pair inside a node, the
    pipeline across the two (pp is the slowest axis of the mesh)."""
    run, port = tmp_path / "run", free_port()
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "4",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "-m", "meshtrain", "train", "--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1",
           "--microbatches", "2", "--steps", "6", "--run-dir", str(run), *SMALL]
    nodes = [subprocess.Popen(cmd[:1] + ["--node-rank", str(k)] + cmd[1:], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in range(2)]
    outs = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "Plan(dp=2, pp=2, tp=2, zero=1, microbatches=2)" in outs[0][0] + outs[1][0]
    ours, theirs = losses(run), losses(one_process)
    assert [step for step, _ in ours] == [step for step, _ in theirs]
    for (step, a), (_, b) in zip(ours, theirs):
        assert abs(a - b) <= 1e-5, (step, a, b)


def test_tensor_parallel_with_sequence_parallel_matches_one_process(one_process, tmp_path):
    run = tmp_path / "run"
    out = meshtrain("train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--steps", "6",
                    "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    assert "Plan(tp=2, sequence_parallel=True)" in out.stdout
    ours, theirs = losses(run), losses(one_process)
    assert [step for step, _ in ours] == [step for step, _ in theirs]
    for (step, a), (_, b) in zip(ours, theirs):
        assert abs(a - b) <= 1e-5, (step, a, b)


def tree(folder) -> dict[str, bytes]:
    """Every file under `folder` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 2-rank run stopped after 3 of 6 steps (a checkpoint every step)."""
    run = tmp_path_factory.mktemp("three") / "run"
    out = meshtrain("train", "--nproc", "2", "--steps", "3", "--run-dir", str(run), *SMALL,
                    "--ckpt-every", "1")
    assert out.returncode == 0, out.stderr
    return run


def test_a_copied_run_resumes_where_it_is(one_process, three_steps, tmp_path):
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(three_steps, copy)
    original = tree(three_steps)
    resumed = meshtrain("train", "--resume", str(copy), "--steps", "6", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    # the numbers of an uninterrupted run
    assert losses(copy) == losses(one_process)
    assert (copy / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert json.loads((copy / "config.json").read_text())["run_dir"] == str(copy)
    assert tree(three_steps) == original   # the original is untouched


def test_a_crafted_checkpoint_is_refused_in_one_line(three_steps, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(three_steps, run)
    from tests.unit.test_checkpoint_safety import resign

    for metadata in run.glob("checkpoints/step_*/.metadata"):
        metadata.write_bytes(pickle.dumps(_System(f"touch {marker}")))
        resign(metadata.parent)   # the manifest rewritten too: the unpickler must refuse it
    before = tree(run)
    out = meshtrain("train", "--resume", str(run), "--steps", "6", "--no-progress")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"meshtrain train: cannot resume {run}: ")
    assert "refers to posix.system" in lines[0] and "Refused" in lines[0]
    assert not marker.exists()
    assert tree(run) == before


class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_mfu_in_summary_and_metrics_follows_the_arithmetic(one_process):
    from meshtrain.models.registry import build_model
    s = json.loads(Path(one_process, "summary.json").read_text())
    config = json.loads(Path(one_process, "config.json").read_text())
    built = build_model(config["model"], config["model_overrides"], config["seq_len"])
    n = sum(p.numel() for p in built.module.parameters())
    assert s["flops_per_token"] == 6 * n + 12 * 2 * 32 * 32
    assert s["peak_source"].startswith("measured: ") and s["peak_flops"] > 0   # CPU: no table
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * s["flops_per_token"] / s["peak_flops"])
    steps = [m for m in metrics(one_process) if "loss" in m]
    assert len(steps) == 6 and all(m["mfu"] == pytest.approx(
        m["tokens_per_s"] * s["flops_per_token"] / s["peak_flops"]) for m in steps)
    from statistics import median

    from meshtrain.report.figure import text_summary
    from meshtrain.report.run_data import read_run
    assert f"MFU         median {median(m['mfu'] for m in steps):.2%}" in text_summary(
        read_run(one_process))
