"""PowerSGD's Plan fields: bad values and unsupported combinations refused by name, with the
fix, before any rank starts; and the matrices it compresses (the min-rate rule)."""
import pytest

from meshtrain.core.admit import check_plan
from meshtrain.core.plan import Plan, PlanError


@pytest.mark.parametrize("rank", [0, -2, 1.5, True, "4"])
def test_compression_rank_must_be_whole_and_positive(rank):
    with pytest.raises(PlanError, match=rf"Plan\.compression_rank={rank!r}: must be a whole "
                                        r"number >= 1 \(e\.g\. 4\)"):
        Plan(dp=2, compression="powersgd", compression_rank=rank)


def test_unknown_compression_lists_the_known_ones():
    with pytest.raises(PlanError, match=r"Plan\.compression='topk': choose one of 'none', "
                                        r"'powersgd'$"):
        Plan(dp=2, compression="topk")


def test_negative_min_rate_refused():
    with pytest.raises(PlanError, match=r"Plan\.compression_min_rate=-1: must be a number >= 0"):
        Plan(dp=2, compression="powersgd", compression_min_rate=-1)


@pytest.mark.parametrize("fields, named", [
    (dict(zero=1), "zero=1"),
    (dict(zero=3), "zero=3"),
    (dict(dp_mode="ps-sync"), "dp_mode='ps-sync'"),
    (dict(dp_mode="diloco"), "dp_mode='diloco'"),
    (dict(pp=2), "pp=2"),
    (dict(tp=2), "tp=2"),
    (dict(precision="bf16"), "precision='bf16'"),
])
def test_compression_outside_plain_ddp_refused_by_name(fields, named):
    with pytest.raises(PlanError, match=rf"Plan\(compression='powersgd'\) with {named}: "
                                        r"PowerSGD is built for DDP's gradient sync only .*"
                                        r"or set compression='none'"):
        check_plan(Plan(dp=2, compression="powersgd", **fields))


def test_defaults_leave_plans_uncompressed_and_round_trip():
    assert Plan().compression == "none"
    plan = Plan(dp=2, compression="powersgd", compression_rank=8)
    assert Plan.from_dict(plan.to_dict()) == plan
