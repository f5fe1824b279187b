"""core/admit.check_plan: every refusal named once, with its problem and its fix; the
command refuses before any rank starts; the run folder keeps the whole Plan."""
import json

import pytest
from torch import nn

import meshtrain as mt
from meshtrain.cli import train_cmd
from meshtrain.cli.main import main
from meshtrain.core.admit import check_plan
from meshtrain.core.plan import Plan, PlanError

# (plan fields, model layers or None, world size or None, the problem, the fix)
REFUSALS = [
    (dict(dp=2, pp=2, dp_mode="ps-sync"), None, None, "dp_mode='ps-sync' with pp=2", "Plan(dp=N)"),
    (dict(dp=2, dp_mode="dp", precision="bf16"), None, None, "run in fp32 for now",
     "Plan(dp=N)"),
    (dict(dp=2, ep=2, compression="powersgd"), None, None, "compression='powersgd'",
     "use dp_mode='ddp', compression='none'"),
    (dict(dp=2, ep=2, dp_mode="ps-sync"), None, None, "ep=2 with dp_mode='ps-sync'",
     "use dp_mode='ddp'"),
    (dict(dp=2, ep=2, cp=2), None, None, "cp with ep=2 is not built yet", "use cp=1"),
    (dict(cp=2, dp_mode="ps-sync"), None, None, "cp with dp_mode='ps-sync' is not built yet",
     "use cp=1"),
    (dict(cp=2, compile=True), None, None, "cp with compile is not built yet", "use cp=1"),
    (dict(cp=2, recompute="selective"), None, None,
     "cp with recompute='selective' is not built yet", "use cp=1"),
    (dict(max_grad_norm=0.0), None, None, "max_grad_norm=0.0: must be a positive", "or None"),
    (dict(dp_mode="ps-async", max_grad_norm=1.0), None, None,
     "max_grad_norm with dp_mode='ps-async'", "use ps-sync, or drop max_grad_norm"),
    (dict(zero=1, offload_dir="/tmp/x"), None, None, "is where offload='disk' writes",
     "set offload='disk'"),
    (dict(zero=2, zero3_units=["embed"]), None, None, "zero3_units names ZeRO-3's",
     "set zero=3 or drop zero3_units"),
    (dict(stage_cuts=[2]), None, None, "stage_cuts is given but Plan.pp=1", "set pp > 1"),
    (dict(pp=2, stage_cuts=[1, 2]), None, None, "stage_cuts=(1, 2): give 1 increasing",
     "between 1 and"),
    (dict(pp=2, stage_cuts=[4]), 4, None, "stage_cuts=(4,)", "between 1 and 3"),
    (dict(tp_plan={"a": "column"}), None, None, "tp_plan is given but Plan.tp=1",
     "set tp > 1"),
    (dict(tp=2, tp_plan={}), None, None, "tp_plan=(): must be a non-empty dict", "pattern"),
    (dict(dp=2), None, 3, "needs dp*pp*tp = 2 ranks but the world has 3", "--nproc 2"),
    (dict(pp=2, microbatches=2, schedule="zb-h1", compile=True), None, None,
     "compile with schedule='zb-h1'", "use schedule='1f1b'"),
    *[(dict(fields, compile="cudagraphs"), None, None,
       f"compile='cudagraphs' with this plan: {why}", "use compile=True")
      for fields, why in [(dict(dp=2, zero=3), "zero=3 frees"),
                          (dict(tp=2), "tensor parallel's collectives"),
                          (dict(pp=2, microbatches=2), "a pipeline runs"),
                          (dict(recompute="selective"), "recomputation runs"),
                          (dict(dp=2, dp_mode="ps-async"), "dp_mode='ps-async' runs")]],
]


@pytest.mark.parametrize("fields, layers, world, problem, fix", REFUSALS,
                         ids=[r[3][:40] for r in REFUSALS])
def test_each_refusal_names_problem_and_fix(fields, layers, world, problem, fix):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)]) if layers else None
    with pytest.raises(PlanError) as info:
        check_plan(Plan(**fields), model, world)
    assert problem in str(info.value) and fix in str(info.value), str(info.value)


def test_the_whole_plan_round_trips_and_runs_checks():
    plan = Plan(dp=2, zero=3, offload="disk", offload_dir="/tmp/o", zero3_units=["a", "b"],
                max_grad_norm=1.0, measure_activations=True)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    piped = Plan(pp=2, tp=2, stage_cuts=[2], tp_plan={"x.*": "column"}, compile="aot_eager")
    assert Plan.from_dict(json.loads(json.dumps(piped.to_dict()))) == piped
    check_plan(plan, world_size=2)
    check_plan(piped, nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)]), 4)


def test_trainer_refuses_through_check_plan():
    with pytest.raises(PlanError, match="set zero=3 or drop zero3_units"):
        mt.Trainer(nn.Linear(2, 2), Plan(zero3_units=["x"]), optimizer=None,
                   loss_fn=lambda o, t: o.sum())


def _no_launch(monkeypatch):
    launched = []
    import sys
    monkeypatch.setattr(sys.modules["meshtrain.launch"], "launch",
                        lambda fn, **k: launched.append(k) or [{}])
    monkeypatch.setattr(train_cmd, "print_summary", lambda s: None)
    monkeypatch.setattr(train_cmd, "print_report", lambda d: None)
    return launched


def test_cli_refuses_before_any_rank(tmp_path, monkeypatch, capsys):
    launched = _no_launch(monkeypatch)
    code = main(["train", "--nproc", "2", "--offload-dir", str(tmp_path / "o"),
                 "--run-dir", str(tmp_path / "run")])
    assert code == 2 and not launched
    assert "offload_dir (--offload-dir) is where offload='disk' writes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_run_dir_that_cannot_be_made_is_one_line(monkeypatch, capsys):
    launched = _no_launch(monkeypatch)
    code = main(["train", "--nproc", "2", "--run-dir", "/proc/x/run"])
    err = capsys.readouterr().err
    assert code == 2 and not launched
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--run-dir /proc/x/run: cannot create the run folder" in err and "writable" in err


@pytest.mark.parametrize("plan", [
    Plan(dp=2, zero=3, offload="disk", offload_dir="OFFLOAD", zero3_units=["blocks.0"],
         max_grad_norm=0.5, measure_activations=True),
    Plan(pp=2, stage_cuts=[2], measure_activations=True),
    Plan(dp=2, compile=True, measure_activations=True),
], ids=["zero3-offload-units", "stage-cuts", "compile"])
def test_resume_reads_the_whole_plan_from_config(plan, tmp_path, monkeypatch):
    from meshtrain.train.config import RunConfig

    if plan.offload_dir:
        plan = Plan.from_dict(dict(plan.to_dict(), offload_dir=str(tmp_path / "off")))
    run = tmp_path / "run"
    run.mkdir()
    RunConfig(run_dir=str(run), plan=plan.to_dict(), batch_size=8, steps=2).save()
    launched = _no_launch(monkeypatch)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    (config,) = launched[0]["args"]
    assert Plan.from_dict(config.plan) == plan


@pytest.mark.parametrize("flag, value", [([], False), (["--compile"], True),
                                         (["--compile", "aot_eager"], "aot_eager")])
def test_cli_compile_flag_reaches_the_plan(flag, value, tmp_path, monkeypatch):
    launched = _no_launch(monkeypatch)
    assert main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), *flag]) == 0
    (config,) = launched[0]["args"]
    plan = Plan.from_dict(config.plan)
    assert plan.compile == value
    assert plan.compile_backend == {False: None, True: "inductor",
                                    "cudagraphs": "inductor"}.get(value, value)
    assert plan.compile_mode is None
    graphs = Plan(compile="cudagraphs")   # --compile cudagraphs on a GPU (refused on a CPU)
    assert (graphs.compile_backend, graphs.compile_mode) == ("inductor", "reduce-overhead")


@pytest.mark.parametrize("mode", ["diloco", "local-sgd"])
def test_a_local_steps_checkpoint_resumes_on_its_own_dp_refused_before_any_rank(
        mode, tmp_path, monkeypatch, capsys):
    from meshtrain.train.config import RunConfig, write_latest

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    plan = Plan(dp=2, dp_mode=mode, sync_every=4)
    RunConfig(run_dir=str(run), plan=plan.to_dict(), batch_size=8, steps=8).save()
    launched = _no_launch(monkeypatch)
    # no checkpoint yet: a new --nproc is a new dp, as for every dp mode
    assert main(["train", "--resume", str(run), "--nproc", "4", "--no-progress"]) == 0
    assert Plan.from_dict(launched[0]["args"][0].plan).dp == 4
    write_latest(run, "step_00000004")
    assert main(["train", "--resume", str(run), "--nproc", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(launched) == 1 and "Traceback" not in err
    assert (f"this {mode} run's checkpoint holds 2 workers' own parameters and optimizer "
            "states; resume it with --nproc 2 (its dp=2), not 4") in err


def test_resume_refuses_the_flags_it_would_ignore(tmp_path, monkeypatch, capsys):
    from meshtrain.train.config import RunConfig

    run = tmp_path / "run"
    run.mkdir()
    RunConfig(run_dir=str(run), plan=Plan(dp=2).to_dict(), batch_size=8, steps=2).save()
    launched = _no_launch(monkeypatch)
    assert main(["train", "--resume", str(run), "--zero", "3", "--lr", "0.5",
                 "--model", "tiny", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert not launched and "Traceback" not in err
    assert "so --model, --lr, --zero would be ignored: drop them" in err, err
    assert main(["train", "--resume", str(run), "--steps", "4", "--nproc", "2",
                 "--no-progress"]) == 0   # what a resume takes
    assert launched[0]["args"][0].steps == 4
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 2   # nothing left to run
    assert ("--steps 3: " + f"{run} is already at step 4 (its latest checkpoint); give a "
            "larger --steps") in capsys.readouterr().err
    assert len(launched) == 1
