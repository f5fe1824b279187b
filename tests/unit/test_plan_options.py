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
    with pytest.raises(PlanError, match="zero3_regather with schedule='interleaved'"):
        _plan(*stages, "--zero3-regather", "--schedule", "interleaved", "--virtual-stages", "2")


def test_the_fp8_recipe_needs_fp8():
    plan = _plan("--precision", "fp8-emulated", "--fp8-recipe", "rowwise")
    assert (plan.precision, plan.fp8_recipe, plan.fp8_emulate) == ("fp8", "rowwise", True)
    assert _plan().fp8_recipe == "tensorwise"
    with pytest.raises(PlanError, match="need precision='fp8'"):
        _plan("--fp8-recipe", "rowwise")
