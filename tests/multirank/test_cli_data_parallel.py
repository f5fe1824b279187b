"""`meshtrain train --dp-mode dp|ps-sync|ps-async`: the same numbers as one process (DP in
one process, the parameter server on local ranks), the straggler option. (Bad input:
tests/unit/test_bad_input.py.)"""
import pytest

from tests.multirank.test_cli_train import SMALL, losses, meshtrain, one_process  # noqa: F401


@pytest.mark.parametrize("args, plan", [
    (["--dp-mode", "dp", "--dp", "2"], "Plan(dp=2, dp_mode='dp')"),
    (["--nproc", "2", "--dp-mode", "ps-sync", "--ps-shards", "2"],
     "Plan(dp=2, dp_mode='ps-sync', ps_shards=2)"),
    (["--nproc", "2", "--dp-mode", "ps-async", "--straggler", "1:0.01",
      "--link", "dp=10Gb/s,0.1ms"],
     "Plan(dp=2, dp_mode='ps-async')"),
])
def test_data_parallel_family_matches_one_process(one_process, tmp_path, args, plan):
    run = tmp_path / "run"
    out = meshtrain("train", "--steps", "6", "--run-dir", str(run), *args, *SMALL)
    assert out.returncode == 0, out.stderr
    assert plan in out.stdout
    if "--link" in args:   # emulation is labelled in the summary, summary.json and metrics
        assert "EMULATED LINK (dp=10Gb/s,0.1ms)" in out.stdout
        assert "EMULATED LINK" in (run / "summary.json").read_text()
        assert "EMULATED LINK" in (run / "metrics.jsonl").read_text().splitlines()[1]
    for (step, a), (same, b) in zip(losses(run), losses(one_process), strict=True):
        assert step == same and abs(a - b) <= 1e-5, (step, a, b)
