"""The CUDA tier's cases (device_cases.py), checked where the suite runs: the list covers
every strategy, and a few cases of each kind of check run here on CPU ranks, so that the
code the GPU runs is this suite's own."""
import pytest

import meshtrain as mt
from meshtrain.core.plan import SCHEDULES
from tests.multirank import device_cases as dc


def test_the_cases_cover_every_strategy():
    plans = [mt.Plan(**case.plan) for case in dc.CASES.values()]
    assert {p.dp_mode for p in plans} == {"ddp", "dp", "ps-sync", "ps-async"}
    assert {p.zero for p in plans} == {0, 1, 2, 3}
    assert {p.offload for p in plans} == {"none", "cpu", "disk"}
    assert {p.schedule for p in plans if p.pp > 1} == set(SCHEDULES)
    assert {p.precision for p in plans} == {"fp32", "bf16"}
    assert any(p.recompute == "full" for p in plans)
    assert any(p.tp > 1 and p.sequence_parallel for p in plans)
    assert any(p.dp > 1 and p.pp > 1 and p.tp > 1 for p in plans)   # 3D
    assert {p.zero for p in plans if p.ep > 1} >= {0, 1}
    assert any(p.ep < p.dp for p in plans)   # experts data-parallel over their edp group
    assert any(p.ep > 1 and p.pp > 1 for p in plans)   # the router's loss across stages
    assert {p.cp_style for p in plans if p.cp > 1} == {"ring", "all-to-all"}
    assert all(case.world == mt.Plan(**case.plan).world_size for case in dc.CASES.values())
    assert {p.compile for p in plans} == {False, True, "cudagraphs"}
    assert sorted(n for n, c in dc.CASES.items() if c.world == 1) == [
        "bf16-world1", "compile-world1", "cudagraphs-world1", "ddp-world1", "dp-master",
        "zero3-world1"]


# one of each kind: a world-1 plan, bf16's own check, disk offload's folder, a pipeline
@pytest.mark.parametrize("name", ["dp-master", "bf16", "offload-disk", "pp-zb-h1"])
def test_a_case_of_each_kind_runs_on_cpu_ranks(name, tmp_path):
    dc.check_case(name, "cpu", tmp_path)
