"""Training on token shards, resumed under other plans: the global order of windows is a
function of (seed, step), so a run resumed on dp 4, or on pp 2 x tp 2, reads the windows an
uninterrupted dp 2 run reads (same hashes) and, under SGD, gives its losses."""
import json
import shutil

import numpy as np
import pytest

from meshtrain.cli.main import main
from meshtrain.data.shards import write_shard
from tests.multirank.test_cli_train import meshtrain, metrics

SMALL = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "8",
         "--no-progress", "--eval-every", "2", "--ckpt-every", "2", "--optimizer", "sgd",
         "--warmup", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    # a repeating pattern with noise: something to learn, so the losses move
    pattern = rng.integers(0, 300, 97)
    for name, n in [("d_train_000001.bin", 40_000), ("d_val_000000.bin", 4_000)]:
        tokens = np.resize(pattern, n)
        noise = rng.random(n) < 0.2
        tokens[noise] = rng.integers(0, 300, noise.sum())
        write_shard(data / name, tokens, np.uint16)
    run = root / "run"
    env = pytest.MonkeyPatch()   # the largest id of these bare shards, cached here
    env.setenv("XDG_CACHE_HOME", str(root / "cache"))
    out = meshtrain("train", "--nproc", "2", "--data", str(data), "--steps", "4",
                    "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    yield run, data
    env.undo()


def _resume_from_step_2(run, tmp_path, plan=None, nproc="4"):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000004")
    (copy / "checkpoints" / "latest").write_text("step_00000002\n")
    if plan:   # the command keeps a run's pp and tp; the checkpoint loads under any plan
        config = json.loads((copy / "config.json").read_text())
        config["plan"].update(plan)
        (copy / "config.json").write_text(json.dumps(config))
    out = meshtrain("train", "--resume", str(copy), "--nproc", nproc, "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "resumed at step 2" in out.stdout
    return copy


def _steps(run):
    return {m["step"]: m for m in metrics(run) if "loss" in m}


@pytest.mark.parametrize("plan", [None, {"dp": 1, "pp": 2, "tp": 2}], ids=["dp4", "pp2xtp2"])
def test_resumed_under_another_plan_reads_the_same_windows_and_losses(uninterrupted, tmp_path,
                                                                       plan):
    run, _ = uninterrupted
    resumed = _resume_from_step_2(run, tmp_path, plan)
    saved = json.loads((resumed / "config.json").read_text())["plan"]
    assert (saved["dp"], saved["pp"], saved["tp"]) == ((4, 1, 1) if plan is None else (1, 2, 2))
    want, got = _steps(run), _steps(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step]["windows"] == want[step]["windows"]
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5)
    assert want[4]["loss"] < want[1]["loss"] - 0.01   # it learns: the losses are not constant
    assert len({want[s]["windows"] for s in want}) == 4


def test_the_checkpoint_records_the_data_position(uninterrupted):
    run, _ = uninterrupted
    meta = json.loads((run / "checkpoints" / "step_00000004" / "meshtrain.json").read_text())
    position = meta["extra"]["data"]
    assert position["next_step"] == 4 and position["batch_size"] == 8
    assert position["seq_len"] == 32 and len(position["fingerprint"]) == 16
    summary = json.loads((run / "summary.json").read_text())   # the split, stated
    assert "(2 shard(s), 44,000 tokens; validation: the shards named *val* (1))" in \
        summary["data"]


def test_a_resume_on_changed_data_is_refused_before_any_rank_starts(uninterrupted, tmp_path,
                                                                   capsys):
    run, data = uninterrupted
    changed = tmp_path / "data"
    shutil.copytree(data, changed)
    write_shard(changed / "d_train_000002.bin", np.arange(500) % 300, np.uint16)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, data=str(changed))))
    assert main(["train", "--resume", str(copy), "--steps", "6", "--no-progress"]) == 2
    assert f"--data {changed}: the data differs from what the checkpoint was trained on" \
        in capsys.readouterr().err
