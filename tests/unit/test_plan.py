"""Plan validation: every bad field is refused with a message naming the value and the fix."""
import pytest

from meshtrain.core.plan import Plan, PlanError


@pytest.mark.parametrize("field", ["dp", "pp", "tp", "cp", "ep", "microbatches",
                                   "virtual_stages"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_sizes_must_be_whole_numbers_at_least_one(field, value):
    with pytest.raises(PlanError, match=rf"Plan\.{field}={value!r}: must be a whole number >= 1"):
        Plan(**{field: value})


@pytest.mark.parametrize("field, value, choices", [
    ("dp_mode", "horovod", "'ddp', 'dp', 'ps-sync', 'ps-async', 'diloco', 'local-sgd'"),
    ("offload", "nvme", "'none', 'cpu', 'disk'"),
    ("schedule", "zb-v", "'naive', 'gpipe', '1f1b', 'interleaved', 'zb-h1'"),
    ("precision", "fp16", "'fp32', 'bf16', 'fp8'"),
    ("cp_style", "ulysses", "'ring', 'all-to-all'"),
])
def test_unknown_choice_lists_the_allowed_ones(field, value, choices):
    with pytest.raises(PlanError, match=rf"Plan\.{field}='{value}': choose one of {choices}$"):
        Plan(**{field: value})


@pytest.mark.parametrize("zero", [-1, 4, 1.0, "1"])
def test_zero_out_of_range(zero):
    with pytest.raises(PlanError, match=rf"Plan\.zero={zero!r}: must be 0, 1, 2 or 3"):
        Plan(zero=zero)


@pytest.mark.parametrize("staleness", [-1, 0.5])
def test_staleness_must_be_non_negative_integer(staleness):
    with pytest.raises(PlanError, match=rf"Plan\.staleness={staleness!r}: must be a whole"):
        Plan(dp_mode="ps-async", staleness=staleness)


@pytest.mark.parametrize("mode", ["ddp", "dp", "ps-sync"])
def test_staleness_needs_ps_async(mode):
    with pytest.raises(PlanError, match=rf"staleness=2 only applies to dp_mode='ps-async' "
                                        rf"\(got dp_mode='{mode}'\)"):
        Plan(dp_mode=mode, staleness=2)
    assert Plan(dp_mode="ps-async", staleness=2).staleness == 2


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_needs_zero(offload):
    with pytest.raises(PlanError, match=rf"Plan\.offload='{offload}' needs ZeRO \(zero >= 1\)"):
        Plan(offload=offload)
    assert Plan(zero=1, offload=offload).offload == offload


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
def test_virtual_stages_need_interleaved(schedule):
    with pytest.raises(PlanError, match=rf"virtual_stages=2 needs schedule='interleaved' "
                                        rf"\(got '{schedule}'\)"):
        Plan(pp=2, virtual_stages=2, schedule=schedule)
    assert Plan(pp=2, virtual_stages=2, schedule="interleaved",
                microbatches=2).virtual_stages == 2


def test_interleaved_needs_microbatches_a_multiple_of_pp():
    with pytest.raises(PlanError, match="microbatches=1 must be a multiple of pp=2"):
        Plan(pp=2, virtual_stages=2, schedule="interleaved")


@pytest.mark.parametrize("bucket_mb", [0, -1.0, "4", None])
def test_bucket_size_must_be_positive(bucket_mb):
    with pytest.raises(PlanError, match=r"Plan\.bucket_mb=.*must be a positive size in MiB"):
        Plan(bucket_mb=bucket_mb)


def test_zero_needs_ddp_mode():
    with pytest.raises(PlanError, match=r"Plan\.zero=1 .* needs dp_mode='ddp' \(got 'ps-sync'\)"):
        Plan(zero=1, dp_mode="ps-sync")


def test_plan_is_frozen():
    with pytest.raises(AttributeError):
        Plan().dp = 2


def test_world_size_is_the_product_of_axes():
    assert Plan(dp=3, pp=2, tp=4).world_size == 24
    Plan(dp=3, pp=2, tp=4).check_world_size(24)


def test_context_parallel_ranks_are_a_mesh_axis_expert_ranks_come_from_dp():
    assert Plan(dp=2, cp=4, tp=2).world_size == 16   # cp multiplies the mesh
    assert Plan(dp=4, ep=2).world_size == 4          # ep is taken from the dp ranks
    with pytest.raises(PlanError, match=r"Plan\(dp=2, pp=1, tp=1, cp=2\) needs dp\*pp\*cp\*tp = 4"):
        Plan(dp=2, cp=2).check_world_size(2)
    with pytest.raises(PlanError, match=r"Plan\(ep=3, dp=4\): .* ep must divide dp; use dp=3"):
        Plan(dp=4, ep=3)
    with pytest.raises(PlanError, match=r"cp_style='all-to-all' .* needs cp > 1"):
        Plan(cp_style="all-to-all")


def test_check_world_size_names_both_numbers_and_the_fix():
    plan = Plan(dp=2, pp=2, tp=2)
    with pytest.raises(PlanError) as info:
        plan.check_world_size(4)
    message = str(info.value)
    assert "Plan(dp=2, pp=2, tp=2) needs dp*pp*tp = 8 ranks but the world has 4" in message
    assert "--nproc 8" in message and "dp*pp*tp = 4" in message


def test_round_trip_through_dict():
    plan = Plan(dp=2, pp=4, tp=2, zero=1, offload="cpu", microbatches=8, schedule="interleaved",
                virtual_stages=2, bucket_mb=0.5, precision="bf16")
    data = plan.to_dict()
    assert data["pp"] == 4 and data["offload"] == "cpu" and data["bucket_mb"] == 0.5
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict({}) == Plan()
    assert Plan.from_dict(Plan().to_dict()) == Plan()


def test_from_dict_refuses_unknown_fields_by_name():
    with pytest.raises(PlanError, match=r"unknown Plan field\(s\) \['dpp', 'zero3'\]; known "
                                        r"fields: \[.*'bucket_mb'.*\]"):
        Plan.from_dict({"dp": 2, "dpp": 2, "zero3": True})


def test_from_dict_still_validates_values():
    with pytest.raises(PlanError, match=r"Plan\.dp=0"):
        Plan.from_dict({"dp": 0})


def test_describe_lists_only_non_defaults():
    assert Plan().describe() == "Plan()"
    assert Plan(dp=2, schedule="gpipe").describe() == "Plan(dp=2, schedule='gpipe')"


@pytest.mark.parametrize("value", ["fast", 1, None, "eager"])
def test_compile_names_its_choices(value):
    with pytest.raises(PlanError, match=rf"Plan\.compile={value!r}: choose True \(inductor\), "
                                        "False, or a backend name: 'inductor', 'aot_eager'"):
        Plan(compile=value)
