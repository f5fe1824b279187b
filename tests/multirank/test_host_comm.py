"""`Comm.on_host()`: a parameter server's gloo groups over the same ranks as the mesh's axes.

On CPU the mesh's groups are gloo and are used as they are; beside NCCL (mocked here: no GPU
in CI) every rank creates a gloo group per axis group, and each keeps the one with its own
ranks. Traffic on it is counted in the Comm's own counters."""
import torch
import torch.distributed as dist

from meshtrain.core import host_comm
from meshtrain.core.comm import Comm
from meshtrain.core.mesh import AXES, Mesh
from meshtrain.core.plan import Plan
from meshtrain.testing import run_ranks


def host_groups():
    mesh = Mesh.build(Plan(dp=2, tp=2))
    comm = Comm(mesh)
    same = comm.on_host()
    kept = all(same.group(a) is mesh.group(a) for a in AXES)   # gloo already: reused
    real = dist.get_backend
    host_comm.dist.get_backend = lambda group=None: "nccl"     # as the mesh's groups on CUDA
    try:
        made = {a: host_comm.gloo_group(mesh, a) for a in AXES}
    finally:
        host_comm.dist.get_backend = real
    ranks = {a: (dist.get_process_group_ranks(made[a]), dist.get_process_group_ranks(mesh.group(a)),
                 real(made[a])) for a in AXES}
    x = torch.full((3,), float(mesh.rank))
    dist.all_reduce(x, group=made["dp"])
    same.all_reduce(torch.ones(4), "dp", tag="push")
    return kept, ranks, x.tolist(), comm.stats.total(axis="dp", tag="push").calls


def test_host_groups_cover_the_mesh_axes():
    for rank, (kept, ranks, summed, calls) in enumerate(run_ranks(4, host_groups)):
        assert kept
        for axis, (made, mesh_ranks, backend) in ranks.items():
            assert made == mesh_ranks and backend == "gloo", (rank, axis)
        partner = rank ^ 2   # dp pairs (0, 2) and (1, 3) with tp fastest-varying
        assert summed == [float(rank + partner)] * 3
        assert calls == 1   # the host Comm charges the Comm it came from
