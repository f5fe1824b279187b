"""The rank layout as pure functions (no processes), and gradient buckets."""
import pytest
import torch
from torch import nn

from meshtrain.core.mesh import Mesh, axis_groups, coordinates, rank_grid
from meshtrain.core.plan import Plan
from meshtrain.strategies.shared.buckets import build_buckets


def test_rank_grid_is_row_major_with_tp_fastest():
    grid = rank_grid(2, 2, 1, 2)
    assert grid.shape == (2, 2, 1, 2)
    assert grid.flatten().tolist() == list(range(8))
    assert grid[:, :, 0].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert rank_grid(1, 3, 1, 1).flatten().tolist() == [0, 1, 2]
    assert rank_grid(2, 3, 5, 4)[1, 2, 3, 3].item() == 1 * 60 + 2 * 20 + 3 * 4 + 3


def test_axis_groups_of_a_2x2x2_mesh():
    grid = rank_grid(pp=2, dp=2, cp=1, tp=2)
    assert axis_groups(grid, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(grid, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(grid, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(grid, "dp_cp") == axis_groups(grid, "dp")   # cp = 1: dp itself


def test_cp_sits_between_dp_and_tp_and_dp_cp_flattens_them():
    grid = rank_grid(pp=1, dp=2, cp=2, tp=2)   # rank = 4 dp + 2 cp + tp
    assert axis_groups(grid, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(grid, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(grid, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # dp slowest inside the flattened axis: dp_cp rank = dp * cp_size + cp
    assert axis_groups(grid, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("shape", [(1, 4, 1, 1), (2, 3, 1, 4), (3, 1, 2, 2), (4, 2, 2, 1)])
def test_axis_groups_partition_the_world(shape):
    grid = rank_grid(*shape)
    sizes = dict(zip(("pp", "dp", "cp", "tp"), shape), dp_cp=shape[1] * shape[2])
    for axis, size in sizes.items():
        groups = axis_groups(grid, axis)
        assert len(groups) == grid.numel() // size
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(grid.numel()))
        varying = {"dp", "cp"} if axis == "dp_cp" else {axis}
        for group in groups:  # members differ in this axis's coordinates only
            coords = [coordinates(grid, r) for r in group]
            if axis != "dp_cp":
                assert [c[axis] for c in coords] == list(range(size))
            else:
                assert [c["dp"] * shape[2] + c["cp"] for c in coords] == list(range(size))
            for other in {"pp", "dp", "cp", "tp"} - varying:
                assert len({c[other] for c in coords}) == 1


def test_coordinates():
    grid = rank_grid(2, 2, 1, 2)
    assert coordinates(grid, 0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert coordinates(grid, 5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert coordinates(grid, 6) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0}
    big = rank_grid(2, 3, 2, 4)
    for rank in range(48):
        c = coordinates(big, rank)
        assert big[c["pp"], c["dp"], c["cp"], c["tp"]].item() == rank
    with pytest.raises(ValueError, match="rank 8 is not in a mesh of 8 ranks"):
        coordinates(grid, 8)


def test_flattened_axis_ranks_and_global_ranks_follow_the_grid():
    """Mesh's own arithmetic for dp_cp (no process group needed) agrees with axis_groups."""
    shape = {"pp": 1, "dp": 2, "cp": 3, "tp": 2}
    grid = rank_grid(**shape)
    for rank in range(grid.numel()):
        mesh = Mesh(shape=shape, coords=coordinates(grid, rank), rank=rank,
                    device=torch.device("cpu"))
        group = next(g for g in axis_groups(grid, "dp_cp") if rank in g)
        assert mesh.size("dp_cp") == 6 and group[mesh.axis_rank("dp_cp")] == rank
        assert [mesh.global_rank("dp_cp", i) for i in range(6)] == group
        assert mesh.replica_axis == "dp_cp"


def test_global_rank_is_the_grids_entry():
    """global_rank's arithmetic is rank_grid's layout: for every rank of a 2x3x2x2 mesh, each
    axis's member i is the grid's rank at this rank's coordinates with that axis set to i."""
    shape = {"pp": 2, "dp": 3, "cp": 2, "tp": 2}
    grid = rank_grid(**shape)
    for rank in range(grid.numel()):
        coords = coordinates(grid, rank)
        mesh = Mesh(shape=shape, coords=coords, rank=rank, device=torch.device("cpu"))
        for axis in shape:
            for i in range(shape[axis]):
                where = dict(coords, **{axis: i})
                assert mesh.global_rank(axis, i) == grid[tuple(where[a] for a in shape)].item()


def test_single_process_mesh():
    mesh = Mesh.build(Plan())
    assert mesh.world_size == 1 and mesh.rank == 0
    assert mesh.group("dp") is None and mesh.size("dp") == 1 and mesh.axis_rank("tp") == 0
    with pytest.raises(ValueError, match=r"unknown mesh axis 'xp'"):
        mesh.size("xp")
    from meshtrain.core.plan import PlanError
    with pytest.raises(PlanError, match="needs dp\\*pp\\*tp = 2 ranks but the world has 1"):
        Mesh.build(Plan(dp=2))


def _params(*shapes, dtype=torch.float32):
    return [nn.Parameter(torch.randn(*s).to(dtype)) for s in shapes]


def test_buckets_close_at_the_cap_in_the_order_given():
    params = _params((10,), (20,), (5,), (100,), (3,))       # 40, 80, 20, 400, 12 bytes
    buckets = build_buckets(params, bucket_bytes=100)
    # 40+80 >= 100 closes; 20+400 closes; 12 is left over
    assert [[id(p) for p in b.params] for b in buckets] == [
        [id(params[0]), id(params[1])], [id(params[2]), id(params[3])], [id(params[4])]]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [b.buffer.numel() for b in buckets] == [30, 105, 3]
    assert [b.nbytes for b in buckets] == [120, 420, 12]
    assert buckets[1].offsets == [0, 5]


def test_the_first_bucket_closes_at_its_own_cap():
    params = _params((10,), (20,), (5,), (100,), (3,))       # 40, 80, 20, 400, 12 bytes
    buckets = build_buckets(params, bucket_bytes=100, first_bytes=30)
    # 40 >= 30 closes the first; then 80+20 >= 100, 400, and 12 left over
    assert [len(b.params) for b in buckets] == [1, 2, 1, 1]
    assert build_buckets(params, bucket_bytes=1000, first_bytes=1000)[0].params == params


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    params = _params((1000,), (2,), (2,))
    buckets = build_buckets(params, bucket_bytes=64)
    assert [len(b.params) for b in buckets] == [1, 2]
    assert buckets[0].buffer.numel() == 1000


def test_one_bucket_when_the_cap_is_large():
    params = _params((3, 4), (5,), (2, 2, 2))
    (bucket,) = build_buckets(params, bucket_bytes=2**30)
    assert bucket.buffer.numel() == 12 + 5 + 8 and bucket.offsets == [0, 12, 17]


def test_dtypes_never_share_a_bucket():
    params = (_params((4,)) + _params((4,), dtype=torch.float64) + _params((4,), (4,)))
    buckets = build_buckets(params, bucket_bytes=2**30)
    assert [len(b.params) for b in buckets] == [1, 1, 2]
    assert [b.buffer.dtype for b in buckets] == [torch.float32, torch.float64, torch.float32]
    assert buckets[1].nbytes == 32


def test_absorb_scales_first_gradients_in_and_accumulates_later_ones():
    params = _params((3, 4), (5,), (2, 3))
    (bucket,) = build_buckets(params, bucket_bytes=2**30)
    bucket.buffer.fill_(99.0)  # stale values from a previous step: overwritten, never summed
    bucket.absorb(0, torch.full((3, 4), 2.0), scale=0.5, first=True)
    bucket.absorb(1, torch.full((5,), 7.0), scale=0.5, first=True)
    bucket.absorb(1, torch.full((5,), 1.0), scale=0.5, first=False)  # a later micro-batch
    bucket.absorb(2, None, scale=0.5, first=True)  # no gradient this step: zero
    expected = torch.cat([torch.full((12,), 1.0), torch.full((5,), 4.0), torch.zeros(6)])
    torch.testing.assert_close(bucket.buffer, expected, rtol=0, atol=0)


def test_grad_views_share_the_bucket_storage():
    params = _params((3, 4), (5,), (2, 3))
    (bucket,) = build_buckets(params, bucket_bytes=2**30)
    for i, p in enumerate(params):
        view = bucket.grad_view(i)
        assert view.shape == p.shape
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
        assert view.data_ptr() == bucket.buffer.data_ptr() + bucket.offsets[i] * 4
    bucket.buffer.fill_(1.5)   # writing the buffer writes every view
    torch.testing.assert_close(bucket.grad_view(1), torch.full((5,), 1.5), rtol=0, atol=0)


def test_ready_set():
    params = _params((2,), (2,))
    (bucket,) = build_buckets(params, bucket_bytes=2**30)
    assert not bucket.mark_ready(params[0])
    assert not bucket.mark_ready(params[0])   # the same parameter twice counts once
    assert bucket.mark_ready(params[1]) and bucket.all_ready
    bucket.reset()
    assert not bucket.all_ready and bucket.handle is None
