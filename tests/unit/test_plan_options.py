"""`meshtrain train`'s plan flags reach the Plan (cli/plan_options.py), and what is not built
with them is refused by name before any rank starts."""
import pytest

from meshtrain.cli.main import build_parser
from meshtrain.cli.train_cmd import build_config
from meshtrain.core.plan import Plan, PlanError


def _plan(*flags: str) -> Plan:
    args = build_parser().parse_args(["train", "--device", "cpu", *flags])
    return Plan.from_dict(build_config(args).plan)


def test_zero3_regather_is_the_policy_the_advisor_offers_under_stages():
    stages = ["--nproc", "4", "--zero", "3", "--pp", "2", "--microbatches", "2"]
    assert _plan(*stages).zero3_regather is False
    assert _plan(*stages, "--zero3-regather").zero3_regather is True
    with pytest.raises(PlanError, match="zero3_regather with schedule='zb-h1'"):
        _plan(*stages, "--zero3-regather", "--schedule", "zb-h1")


def test_the_fp8_recipe_needs_fp8():
    plan = _plan("--precision", "fp8-emulated", "--fp8-recipe", "rowwise")
    assert (plan.precision, plan.fp8_recipe, plan.fp8_emulate) == ("fp8", "rowwise", True)
    assert _plan().fp8_recipe == "tensorwise"
    with pytest.raises(PlanError, match="need precision='fp8'"):
        _plan("--fp8-recipe", "rowwise")


def _round_trip(plan: Plan, parser) -> Plan:
    from meshtrain.cli.plan_options import plan_flags, plan_from_args
    args = parser.parse_args(["train", *plan_flags(plan)])
    return plan_from_args(args, args.nproc)


HAND_MADE = [Plan(dp=2, dp_mode="dp"), Plan(dp=4, dp_mode="ps-async", staleness=2, ps_shards=2),
             Plan(dp=2, dp_mode="diloco", sync_every=8, outer_lr=0.5, outer_momentum=0.8,
                  sync_warmup_steps=3),
             Plan(dp=2, compression="powersgd", compression_rank=2, bucket_mb=4.0),
             Plan(dp=2, pp=2, tp=2, schedule="interleaved", virtual_stages=2, microbatches=4,
                  sequence_parallel=True, recompute="full", recompute_every=2, compile=True),
             Plan(dp=4, zero=3, offload="cpu", precision="fp8", fp8_recipe="rowwise",
                  fp8_emulate=True, max_grad_norm=1.0, compile="aot_eager"),
             Plan(dp=2, cp=2, cp_style="all-to-all", ep=2, capacity_factor=1.25),
             Plan(pp=2, microbatches=2, stage_balance="parameters")]


def test_every_plan_the_advisor_ranks_and_every_flag_make_the_same_plan_back():
    from meshtrain.planner import from_description, make_cluster
    from meshtrain.planner.advisor import advise
    from meshtrain.planner.setup import Setup
    ranked = [e.cand.plan for gpus in (4, 8) for e in advise(
        from_description(8, 1024, 16, 32000, 2048), Setup(global_batch=32),
        make_cluster("H100-80GB", 1, gpus)).ranked]
    assert len(ranked) > 100
    parser = build_parser()
    for plan in ranked + HAND_MADE:
        want = Plan.from_dict({**plan.to_dict(), "measure_activations": True})
        assert _round_trip(plan, parser) == want, plan


def test_every_plan_field_has_a_flag_or_is_named_flagless():
    import dataclasses

    from meshtrain.cli.plan_options import _NOT_FLAGS, FLAGLESS
    parser = build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.values()
                 if a.prog.endswith(" train"))
    flags = {s for action in train._actions for s in action.option_strings}
    missing = [f.name for f in dataclasses.fields(Plan) if f.name not in (*FLAGLESS, *_NOT_FLAGS)
               and "--" + f.name.replace("_", "-") not in flags]
    assert missing == []


def test_a_plan_no_flag_reaches_has_no_command():
    from meshtrain.cli.plan_options import plan_flags
    assert plan_flags(Plan(dp=2, zero=3, zero3_units=("layers.0",))) is None
    assert plan_flags(Plan(pp=2, stage_cuts=(3,))) is None
    assert plan_flags(Plan(dp=2, zero=3, precision="fp8", fp8_emulate=True,
                           zero3_fp8_gather=False)) is None


@pytest.mark.parametrize("nodes", [1, 2])
def test_plan_prints_the_command_that_trains_with_its_fastest_plan(nodes):
    import shlex

    from meshtrain.cli.plan_cmd import train_command
    from meshtrain.cli.plan_options import plan_from_args
    from meshtrain.planner import make_cluster, model_spec
    from meshtrain.planner.advisor import advise
    from meshtrain.planner.setup import Setup
    advice = advise(model_spec.preset("llama3.1-8b", seq=4096), Setup(global_batch=32),
                    make_cluster("H100-80GB", nodes, 8))
    text = train_command(advice, "llama3.1-8b")
    assert "a shape the planner prices" in text   # not a model `train` builds: said so
    line = text.splitlines()[-1].split()
    assert ("torchrun" in line) == (nodes > 1) and ("--nproc" in line) == (nodes == 1)
    argv = line[line.index("train"):]
    if nodes > 1:   # each node's torchrun sets the world
        argv += ["--nproc", str(nodes * 8)]
    args = build_parser().parse_args(argv)
    assert (args.model, args.batch, args.seq) == ("YOUR_MODEL", 32, 4096)
    assert plan_from_args(args, args.nproc) == Plan.from_dict(
        {**advice.ranked[0].cand.full_plan().to_dict(), "measure_activations": True})
    built = shlex.split(train_command(advice, "gpt2-124m").splitlines()[-1])
    assert built[built.index("--model") + 1] == "gpt2-124m"   # a model `train` builds
