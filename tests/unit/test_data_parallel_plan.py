"""Bad data-parallel-family plans are refused with a message that says what to do."""
import pytest

import torch

import meshtrain as mt
from meshtrain.core.plan import PlanError


def test_dp_mode_dp_runs_in_one_process():
    plan = mt.Plan(dp=4, dp_mode="dp")
    assert plan.world_size == 1 and plan.mesh_dp == 1
    plan.check_world_size(1)
    with pytest.raises(PlanError, match=r"threads of one process.*needs pp\*tp = 1.*has 4"):
        plan.check_world_size(4)
    assert mt.Plan(dp=2, tp=2, dp_mode="dp").world_size == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=2, dp_mode="ps-async", staleness=-1), r"staleness=-1: must be a whole number >= 0"),
    (dict(dp=2, dp_mode="ps-sync", staleness=2), r"staleness=2 only applies to dp_mode='ps-async'"),
    (dict(dp=2, staleness=1), r"only applies to dp_mode='ps-async' \(got dp_mode='ddp'\)"),
    (dict(dp=2, dp_mode="ps-sync", ps_shards=3), r"ps_shards=3 is more server shards than the dp=2"),
    (dict(dp=2, ps_shards=2), r"ps_shards=2 shards a parameter server"),
    (dict(dp=2, dp_mode="ps-sync", ps_shards=0), r"ps_shards=0: must be a whole number >= 1"),
    (dict(dp=2, dp_mode="dp", zero=1), r"needs dp_mode='ddp'"),
])
def test_bad_plans_are_refused(kwargs, message):
    with pytest.raises(PlanError, match=message):
        mt.Plan(**kwargs)


def test_async_refuses_gradient_clipping():
    import torch
    with pytest.raises(PlanError, match="max_grad_norm with dp_mode='ps-async'"):
        mt.Trainer(torch.nn.Linear(2, 2), mt.Plan(dp_mode="ps-async", max_grad_norm=1.0),
                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=lambda o, t: o.sum())


def test_unbuilt_combinations_are_named():
    from meshtrain.core.admit import check_plan
    with pytest.raises(PlanError, match="dp_mode='ps-sync' with pp=1, tp=2"):
        check_plan(mt.Plan(dp=2, tp=2, dp_mode="ps-sync"))
    with pytest.raises(PlanError, match="precision='bf16'"):
        check_plan(mt.Plan(dp=2, dp_mode="dp", precision="bf16"))


# ---- DiLoCo and local SGD (issue 30) ----------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(dp=2, dp_mode="diloco", sync_every=0), "sync_every=0: must be a whole number >= 1"),
    (dict(dp=2, dp_mode="diloco", outer_lr=0.0), "outer_lr=0.0: must be a number > 0"),
    (dict(dp=2, dp_mode="diloco", outer_momentum=1.0), r"outer_momentum=1.0: must be in \[0"),
    (dict(dp=2, dp_mode="diloco", outer_momentum=-0.1), "outer_momentum=-0.1"),
    (dict(dp=2, dp_mode="diloco", zero=1), "use zero=0"),
    (dict(dp=2, dp_mode="local-sgd", zero=2), "use zero=0"),
    (dict(dp=1, dp_mode="diloco"), "no other workers to sync with; set dp >= 2"),
    (dict(dp=2, dp_mode="diloco", ps_shards=2), "needs dp_mode='ps-sync' or 'ps-async'"),
    (dict(dp=2, dp_mode="local-sgd", staleness=1), "only applies to dp_mode='ps-async'"),
    (dict(dp=2, dp_mode="ps-sync", sync_every=4), "only applies to dp_mode='diloco'"),
    (dict(dp=2, outer_lr=0.5), "only applies to dp_mode='diloco'"),
    (dict(dp=2, dp_mode="local-sgd", outer_momentum=0.5), "use dp_mode='diloco' to set"),
])
def test_bad_diloco_plans_refused(fields, message):
    from meshtrain.core.admit import check_plan
    with pytest.raises(PlanError, match=message):
        check_plan(mt.Plan(**fields))   # a field's value in Plan, combinations in check_plan


def test_diloco_refuses_clipping_before_any_rank():
    with pytest.raises(PlanError, match="max_grad_norm with dp_mode='diloco' is not built"):
        mt.Trainer(torch.nn.Linear(2, 2), mt.Plan(dp=2, dp_mode="diloco", max_grad_norm=1.0),
                   optimizer=torch.optim.AdamW, loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.parametrize("fields, message", [
    (dict(dp=2, dp_mode="diloco", sync_warmup_steps=-1),
     "sync_warmup_steps=-1: must be a whole number >= 0"),
    (dict(dp=2, compression="powersgd", sync_warmup_steps=2.5),
     "sync_warmup_steps=2.5: must be a whole number"),
    (dict(dp=2, sync_warmup_steps=8), r"delays a slow-link method .* dp_mode='ddp' and no "
                                      "compression; choose one"),
    (dict(dp=2, dp_mode="ps-sync", sync_warmup_steps=8), "dp_mode='ps-sync'"),
])
def test_bad_sync_warmup_refused(fields, message):
    from meshtrain.core.admit import check_plan
    with pytest.raises(PlanError, match=message):
        check_plan(mt.Plan(**fields))
