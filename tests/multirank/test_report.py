"""`meshtrain report`: the picture of a real run shows that run's own numbers (read back from
the figure's data, not its pixels); runs of one step or without evaluation draw; a folder
that is not a run is refused clearly."""
import json
import shutil
import statistics
from pathlib import Path

import pytest

from meshtrain.cli.main import main
from meshtrain.cli.report_cmd import write_report
from meshtrain.report.figure import draw
from meshtrain.report.run_data import read_run
from tests.multirank.test_cli_train import SMALL, meshtrain, metrics


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    out = meshtrain("train", "--nproc", "2", "--steps", "4", "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    assert f"report        {run}/report.png" in out.stdout
    return run


def panels(run):
    loss, speed, memory, sent = draw([read_run(run)]).axes
    return loss, speed, memory, sent


def test_the_picture_shows_the_runs_own_numbers(run_dir):
    records = metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    loss, speed, memory, sent = panels(run_dir)
    train_line, val_line = loss.lines
    assert list(train_line.get_xdata()) == [r["step"] for r in steps]
    assert list(train_line.get_ydata()) == [r["loss"] for r in steps]
    assert list(val_line.get_ydata()) == [r["val_loss"] for r in evals]
    assert list(speed.lines[0].get_ydata()) == [r["tokens_per_s"] for r in steps]
    summary = json.loads((run_dir / "summary.json").read_text())
    for rank, m in enumerate(summary["memory_per_rank"]):
        bars = {p.get_gid().split("/")[2]: p.get_height() for p in memory.patches
                if p.get_gid() and p.get_gid().startswith(f"0/{rank}/")}
        assert bars["parameters"] == m["parameters"] / 2**20
        assert bars["optimizer_states"] == m["optimizer_states"] / 2**20
    (dp_bar,) = [p for p in sent.patches if p.get_gid() == "0/bytes"]
    assert dp_bar.get_height() == statistics.mean(r["bytes_by_axis"]["dp"] for r in steps) / 2**20
    assert dp_bar.get_height() > 0
    assert (run_dir / "report.png").stat().st_size > 10_000


def test_two_runs_are_drawn_together(run_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    out, text = write_report([run_dir, other], tmp_path / "both.png")
    assert out.exists() and text.count("train loss") == 2
    assert len(draw([read_run(run_dir), read_run(other)]).axes[0].lines) == 4


def test_a_run_of_one_step_and_a_run_without_evaluation_draw(run_dir, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(run_dir, one)
    lines = (one / "metrics.jsonl").read_text().splitlines()
    first_step = next(line for line in lines if '"loss"' in line)
    (one / "metrics.jsonl").write_text(first_step + "\n")          # one step, no evaluation
    (one / "summary.json").unlink()                                # and it never ended
    loss, _, memory, _ = panels(one)
    assert len(loss.lines) == 1 and len(loss.lines[0].get_xdata()) == 1
    assert "has not ended" in memory.get_title()
    assert main(["report", str(one)]) == 0


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a meshtrain run folder" in err and "Traceback" not in err


def test_a_run_cut_short_states_mfu_with_the_peak_it_used(run_dir, tmp_path):
    """config.json, written at the start, carries MFU's peak: a run without summary.json
    (Ctrl-C, a failure) still says what its MFU is against."""
    summary = json.loads((run_dir / "summary.json").read_text())
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    (cut / "summary.json").unlink()
    config = json.loads((cut / "config.json").read_text())
    assert (config["peak_flops"], config["peak_source"]) == (summary["peak_flops"],
                                                             summary["peak_source"])
    mfus = [r["mfu"] for r in metrics(cut) if "loss" in r]
    _, text = write_report([cut])
    assert (f"MFU         median {statistics.median(mfus):.2%} (peak "
            f"{summary['peak_flops'] / 1e12:.3g} TFLOP/s per device, {summary['peak_source']})"
            ) in text
    config.pop("peak_flops"), config.pop("peak_source")   # a run from before peaks were kept
    (cut / "config.json").write_text(json.dumps(config))
    assert "(the run did not record its peak)" in write_report([cut])[1]
    records = [{k: v for k, v in r.items() if k != "mfu"} for r in metrics(cut)]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "MFU         none (the run's metrics record no MFU)" in write_report([cut])[1]
