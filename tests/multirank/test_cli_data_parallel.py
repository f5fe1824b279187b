"""`meshtrain train --dp-mode dp|ps-sync|ps-async`: the same numbers as one process (DP in
one process, the parameter server on local ranks), the straggler option, bad input."""
import pytest

from tests.multirank.test_cli_train import SMALL, losses, meshtrain


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    out = meshtrain("train", "--nproc", "1", "--steps", "6", "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    return run


@pytest.mark.parametrize("args, plan", [
    (["--dp-mode", "dp", "--dp", "2"], "Plan(dp=2, dp_mode='dp')"),
    (["--nproc", "2", "--dp-mode", "ps-sync", "--ps-shards", "2"],
     "Plan(dp=2, dp_mode='ps-sync', ps_shards=2)"),
    (["--nproc", "2", "--dp-mode", "ps-async", "--straggler", "1:0.01"],
     "Plan(dp=2, dp_mode='ps-async')"),
])
def test_data_parallel_family_matches_one_process(one_process, tmp_path, args, plan):
    run = tmp_path / "run"
    out = meshtrain("train", "--steps", "6", "--run-dir", str(run), *args, *SMALL)
    assert out.returncode == 0, out.stderr
    assert plan in out.stdout
    for (step, a), (same, b) in zip(losses(run), losses(one_process), strict=True):
        assert step == same and abs(a - b) <= 1e-5, (step, a, b)


@pytest.mark.parametrize("args, message", [
    (["--dp-mode", "dp", "--nproc", "2"], "runs its 2 replicas as threads of one process"),
    (["--nproc", "2", "--dp-mode", "ps-sync", "--ps-shards", "3"],
     "ps_shards=3 is more server shards than the dp=2 ranks"),
    (["--nproc", "2", "--dp-mode", "ps-sync", "--staleness", "1"],
     "staleness=1 only applies to dp_mode='ps-async'"),
    (["--nproc", "2", "--dp-mode", "ps-async", "--staleness", "-1"], "staleness=-1"),
    (["--nproc", "2", "--straggler", "2:0.1"], "rank 2 does not exist in a world of 2"),
    (["--nproc", "2", "--straggler", "1"], "expected RANK:SECONDS"),
    (["--nproc", "2", "--dp-mode", "ps-async", "--max-grad-norm", "1"],
     "max_grad_norm with dp_mode='ps-async'"),
])
def test_bad_input_is_refused_with_a_clear_message(args, message, tmp_path, capsys):
    from meshtrain.cli.main import main

    assert main(["train", "--run-dir", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
