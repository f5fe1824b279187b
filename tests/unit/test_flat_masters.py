"""MasterWeights.flatten (DDP in bf16): masters and parameters laid out as the gradient
buckets, one copy per bucket for the gradients' cast and the write-back, the same numbers
as the per-parameter path."""
import torch
from torch import nn

from meshtrain.strategies.shared.precision import MasterWeights, cast_to


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (5,), (), (4, 2, 3), (7,)]
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _one_step(flat: bool) -> tuple[list[nn.Parameter], MasterWeights, list[torch.Tensor]]:
    params = _params(0)
    masters = MasterWeights(params, "bf16")
    cast_to("bf16", params, [])
    groups = [[params[3], params[0]], [params[4], params[2], params[1]]]   # buckets' order
    if flat:
        masters.flatten(groups)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).bfloat16()
             for i, p in enumerate(params)]
    used = [True, True, False, True, True]
    if flat:
        by_id = {id(p): g for p, g in zip(params, grads)}
        masters.set_group_grads([torch.cat([by_id[id(p)].reshape(-1) for p in g])
                                 for g in groups], used)
    else:
        masters.set_grads([g if u else None for g, u in zip(grads, used)])
    with torch.no_grad():
        for m in masters.masters:
            if m.grad is not None:
                m.add_(m.grad, alpha=-0.1)   # an SGD step on the masters
    masters.write_back()
    return params, masters, grads


def test_flat_masters_step_as_the_per_parameter_path():
    reference, ref_masters, _ = _one_step(flat=False)
    params, masters, _ = _one_step(flat=True)
    for p, m, rp, rm in zip(params, masters.masters, reference, ref_masters.masters):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(m, rm) and torch.equal(p, rp)
    # the unused parameter (index 2) kept its master: the optimizer skipped it
    assert torch.equal(masters.masters[2], MasterWeights(_params(0), "bf16").masters[2])


def test_each_group_is_one_storage_and_gradients_live_only_during_the_step():
    params, masters, _ = _one_step(flat=True)
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 2                        # one flat bf16 tensor per group
    assert len({m.untyped_storage().data_ptr() for m in masters.masters}) == 2
    assert {p.untyped_storage().nbytes() for p in params} == {2 * (24 + 15), 2 * (7 + 1 + 5)}
    # between steps the fp32 gradients hold no memory, and no master points at them
    assert all(m.grad is None for m in masters.masters)
    assert all(g.grads.untyped_storage().nbytes() == 0 for g in masters._groups)
