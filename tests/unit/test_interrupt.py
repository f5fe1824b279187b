"""Ctrl-C (or a kill) of `meshtrain train` while its ranks run: the elastic agent stops the
ranks and raises its SignalException; the command says so in one line and where to resume,
not with the agent's traceback."""
import signal

import pytest


def _never_called():
    raise AssertionError("no rank should start")


def test_launch_turns_the_agents_signal_into_an_interrupt(monkeypatch):
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshtrain.launch import Interrupted, launch

    def stopped(*args, **kwargs):   # what the agent does once it has stopped the workers
        raise SignalException("got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(launcher, "elastic_launch", lambda config, entry: stopped)
    with pytest.raises(Interrupted) as caught:
        launch(_never_called, nproc=1, start_method="spawn")
    assert caught.value.signal_name == "SIGINT"
    assert isinstance(caught.value, KeyboardInterrupt)   # every command answers it as one


def test_an_interrupted_run_says_where_to_resume_in_one_line(tmp_path, monkeypatch, capsys):
    import sys

    import meshtrain.core.processes as processes
    from meshtrain.cli.main import main

    launch_module = sys.modules["meshtrain.launch"]   # meshtrain.launch the name is the function

    def interrupted(*args, **kwargs):
        raise launch_module.Interrupted("SIGINT")

    def stopped(*args, **kwargs):
        raise launch_module.Interrupted("SIGTERM")

    monkeypatch.setattr(processes, "start_forkserver", lambda **kwargs: None)
    monkeypatch.setattr(launch_module, "launch", interrupted)
    (tmp_path / "book.txt").write_text("some text to train on. " * 2000)
    run = tmp_path / "run"
    code = main(["train", "--data", str(tmp_path / "book.txt"), "--steps", "2",
                 "--run-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130   # 128 + SIGINT, as a shell reports it
    assert "Traceback" not in err
    assert "interrupted (SIGINT); the ranks were stopped" in err
    assert (f"It wrote no checkpoint: start the run again (--resume {run} starts it over in "
            "its folder).") in err
    monkeypatch.setattr(launch_module, "launch", stopped)   # a scheduler's SIGTERM
    assert main(["train", "--data", str(tmp_path / "book.txt"), "--steps", "2",
                 "--run-dir", str(tmp_path / "other"), "--no-progress"]) == 143
    assert "interrupted (SIGTERM)" in capsys.readouterr().err
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    from meshtrain.cli.summary import after_failure
    assert after_failure(run, failed=False) == ("The run folder keeps its last checkpoint "
                                                f"(step_00000004): continue with --resume {run}.")


def test_a_resume_without_a_checkpoint_starts_its_metrics_over(tmp_path):
    """`--resume` of a run stopped before its first checkpoint trains from step 0 again:
    its earlier records go, as a restart's do, not doubled after them."""
    import json
    from types import SimpleNamespace

    from meshtrain.train.config import RunConfig
    from meshtrain.train.run import _Metrics, _start_point

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n'
                                            '{"step": 1, "loss": 4.0}\n')
    config = RunConfig(run_dir=str(tmp_path), resume=True)
    trainer = SimpleNamespace(mesh=SimpleNamespace(rank=0), evaluate=lambda val: 5.5)
    metrics = _Metrics(tmp_path / "metrics.jsonl", enabled=True)
    assert _start_point(trainer, config, metrics, val=None) == (0, {"val_loss": 5.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "val_loss": 5.5}]
