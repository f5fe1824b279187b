"""`meshtrain plan --verify --model NAME`: verify's plans on the user's own GPT, those predicted
to fit, with every wrong combination refused before any rank starts."""
import argparse
import json

import pytest

from meshtrain.cli import plan_cmd
from meshtrain.cli.main import main
from meshtrain.core.gpt_shapes import GPT_SHAPES
from meshtrain.core.plan import Plan
from meshtrain.core.units import fmt_duration
from meshtrain.measure import verify, verify_cli
from tests.synthetic_profile import synthetic_profile

PROFILE = synthetic_profile(cpu_count=4, host_mem=48e9)


def _args(*argv):
    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def test_the_model_verified_is_a_preset_or_a_description():
    assert plan_cmd.verified_model(_args("--verify")) is None   # verify's own GPT
    assert plan_cmd.verified_model(_args("--model", "gpt2-124m")) == GPT_SHAPES["gpt2-124m"]
    assert plan_cmd.verified_model(_args("--model", "gpt2-124m", "--seq", "256")) == dict(
        GPT_SHAPES["gpt2-124m"], seq_len=256)
    described = _args("--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100",
                      "--seq", "32")
    assert plan_cmd.verified_model(described) == dict(vocab_size=100, seq_len=32, n_layer=2,
                                                      n_head=4, d_model=64)


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama-7b"], "is a shape the planner describes but does not build"),
    (["--model", "nosuch"], "--model 'nosuch' is unknown"),
    (["--layers", "2", "--hidden", "64"], "needs --heads --vocab --seq too"),
    (["--seq", "64"], "give --model too"),
    (["--model", "tiny", "--layers", "2"], "not both"),
    (["--layers", "2", "--hidden", "60", "--heads", "8", "--vocab", "10", "--seq", "8"],
     "not divisible by n_head"),
])
def test_a_model_verify_cannot_train_is_refused_by_name(capsys, argv, words):
    assert main(["plan", "--verify", *argv]) == 2
    out, err = capsys.readouterr()
    assert words in err and "Traceback" not in err and out == ""


class _Ran(Exception):
    """Stands for the runs: what verify would have started."""


def _verify_command(capsys, monkeypatch, tmp_path, *argv):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))

    def ran(profile, plans, model, **_):
        raise _Ran(plans, model)

    monkeypatch.setattr(verify_cli, "verify", ran)
    with pytest.raises(_Ran) as started:
        main(["plan", "--verify", "--profile", str(path), *argv])
    return (*started.value.args, capsys.readouterr().err)


def runnable(model) -> list:
    """verify's plans, and those of BUILDING whose strategy has landed, that `model` can run
    (an ep plan needs a mixture of experts)."""
    return [pb for pb in verify.PLANS + verify.BUILDING
            if not verify.waits_for_strategy(pb[0]) and not verify.needs_experts(pb[0], model)]


def test_verify_runs_the_given_model_and_only_the_plans_predicted_to_fit(capsys, monkeypatch,
                                                                         tmp_path):
    plans, model, err = _verify_command(capsys, monkeypatch, tmp_path, "--model", "gpt2-124m")
    assert model == GPT_SHAPES["gpt2-124m"]
    every = [(verify.run_plan(plan, "cpu"), batch) for plan, batch in runnable(model)]
    fitting = [pb for pb in every if verify.predict(PROFILE, *pb, model).fits]
    assert 0 < len(fitting) < len(every)   # the host's 48 GB holds some of GPT-2's plans
    assert list(plans) == fitting
    assert f"{len(every) - len(fitting)} predicted not to fit" in err
    steps = verify.ROUNDS * (verify.WARMUP + verify.STEPS) + 1   # one more for exact counts
    seconds = steps * sum(verify.predict(PROFILE, *pb, model).time.total for pb in fitting)
    assert f"predicted to take {fmt_duration(seconds)}" in err and seconds > 3600


def test_verify_without_a_model_runs_its_own_gpt(capsys, monkeypatch, tmp_path):
    plans, model, err = _verify_command(capsys, monkeypatch, tmp_path)
    assert model == verify.VERIFY_GPTS["cpu"] and len(plans) == len(runnable(model))
    assert "predicted not to fit" not in err


def test_verify_takes_any_model_train_builds(capsys, monkeypatch, tmp_path):
    from meshtrain.measure.trained_model import TrainedModel

    plans, model, err = _verify_command(capsys, monkeypatch, tmp_path, "--model", "llama-tiny",
                                        "--seq", "64")
    assert model == TrainedModel("llama-tiny", 64) and "plans of llama-tiny at 64 tokens" in err
    assert len(plans) == len(runnable(model))   # its 2 layers at 64 tokens fit everywhere


def test_a_wait_reads_in_seconds_minutes_or_hours():
    assert [fmt_duration(t) for t in (42, 150, 5400)] == ["42 s", "2 min", "1.5 h"]


def test_a_model_no_plan_fits_is_refused_before_any_run(capsys, monkeypatch, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, "host_mem": 8e9}))
    assert main(["plan", "--verify", "--profile", str(path), "--model", "gpt2-1.3b"]) == 2
    assert "none of --verify's plans is predicted to fit" in capsys.readouterr().err


def test_on_one_gpu_verify_says_what_it_leaves_out_and_why(capsys, monkeypatch, tmp_path):
    """One GPU: the plans of more ranks need more GPUs, the fp32-only family is left out;
    the counts add up to verify's plans."""
    monkeypatch.setattr(verify_cli, "resolve_device", lambda: "cuda")
    monkeypatch.setattr(verify_cli, "gpu_count", lambda: 1)
    plans, model, err = _verify_command(capsys, monkeypatch, tmp_path)
    fp32 = verify_cli.fp32_only("cuda")
    # the two parameter servers, DP, DiLoCo, local SGD and PowerSGD run in fp32 only
    assert model == verify.VERIFY_GPTS["cuda"] and fp32 == 6
    assert all(verify.world_of(p) == 1 for p, _ in plans)
    # cp and ep plans wait for their strategies (named with check_plan's refusal)
    building = sum(bool(verify.waits_for_strategy(p)) for p, _ in verify.BUILDING)
    # ... and ep plans run on a mixture of experts only (this is a GPT)
    no_experts = sum(verify.needs_experts(p, model) and not verify.waits_for_strategy(p)
                     for p, _ in verify.BUILDING)
    more = len(verify.PLANS + verify.BUILDING) - len(plans) - fp32 - building - no_experts
    waiting = (f"; {building} not built yet" if building else "") + (
        f"; {no_experts} need a mixture of experts" if no_experts else "")
    assert f"(AdamW; {more} need more GPUs; {fp32} run in fp32 only{waiting})" in err


def test_verify_repeats_each_plan_the_rounds_given(capsys, monkeypatch, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    asked = {}

    def ran(profile, plans, model, rounds, **_):
        asked["rounds"] = rounds
        raise _Ran()

    monkeypatch.setattr(verify_cli, "verify", ran)
    with pytest.raises(_Ran):
        main(["plan", "--verify", "--profile", str(path), "--rounds", "1"])
    assert asked == {"rounds": 1} and ", 1 round," in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--rounds", "0"], "--rounds 0: must be a whole number >= 1"),
    (["--rounds", "2"], "add either"),
])
def test_rounds_is_refused_where_it_means_nothing(capsys, argv, words):
    assert main(["plan", "--model", "gpt2-124m", *argv]) == 2
    assert words in capsys.readouterr().err


def test_verify_runs_the_cp_plans_and_keeps_ep_for_moe(capsys, monkeypatch, tmp_path):
    """Context and expert parallel are built: the cp plans run as the others; the ep plan
    runs on a mixture of experts' --model only (a GPT has nothing for it to split, said as
    such)."""
    plans, _, err = _verify_command(capsys, monkeypatch, tmp_path)
    assert not any(verify.waits_for_strategy(p) for p, _ in verify.BUILDING)
    assert "not built yet" not in err
    assert [p for p, _ in plans if Plan(**p).cp > 1] == [p for p, _ in verify.BUILDING
                                                          if Plan(**p).cp > 1]
    ep = [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "pp": 2, "microbatches": 4}]   # and pp
    assert [p for p, _ in verify.BUILDING if Plan(**p).ep > 1] == ep
    assert not [p for p, _ in plans if Plan(**p).ep > 1] and "2 need a mixture of experts" in err
    plans, _, err = _verify_command(capsys, monkeypatch, tmp_path, "--model", "mixtral-tiny",
                                    "--seq", "64")
    assert [p for p, _ in plans if Plan(**p).ep > 1] == ep
    assert "need a mixture of experts" not in err
