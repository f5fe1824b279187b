"""The device mesh: every rank is a coordinate (pp, dp, tp), tp varying fastest.

The layout is a pure function (`rank_grid`, `axis_groups`) testable with no processes;
`Mesh` wraps `torch.distributed.device_mesh.DeviceMesh` over that same layout and is passed
explicitly to every strategy (never a global). An "axis" is a mesh dimension; a "dim" is a
tensor dimension.

tp varies fastest so that a tensor-parallel group (the most talkative) is a run of
consecutive ranks, which torchrun places on one node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.core.device import backend_for, rank_device
from meshtrain.core.plan import Plan

AXES = ("pp", "dp", "tp")


def rank_grid(pp: int, dp: int, tp: int) -> torch.Tensor:
    """All ranks as a tensor shaped (pp, dp, tp): grid[i, j, k] is the rank at that coordinate."""
    return torch.arange(pp * dp * tp).reshape(pp, dp, tp)


def axis_groups(grid: torch.Tensor, axis: str) -> list[list[int]]:
    """The groups of an axis: each is the ranks that vary along `axis`, the others fixed."""
    dim = AXES.index(axis)
    moved = grid.movedim(dim, -1)  # (..., axis)
    return moved.reshape(-1, grid.shape[dim]).tolist()


def coordinates(grid: torch.Tensor, rank: int) -> dict[str, int]:
    """This rank's position along each axis."""
    where = (grid == rank).nonzero()
    if where.numel() == 0:
        raise ValueError(f"rank {rank} is not in a mesh of {grid.numel()} ranks")
    return dict(zip(AXES, where[0].tolist()))


def device_for_backend(device: str | None = None) -> tuple[torch.device, str]:
    """The device this rank computes on (from LOCAL_RANK, see core/device.py) and the c10d
    backend of the default group that goes with it."""
    where = rank_device(device)
    return where, backend_for(where)


@dataclass
class Mesh:
    """Named axes over the world: sizes, this rank's coordinates, and one process group per axis.

    Built collectively (every rank must call `Mesh.build` together). With no process group
    initialised and a plan of one rank, it is a trivial mesh with no groups at all.
    """
    shape: dict[str, int]
    coords: dict[str, int]
    rank: int
    device: torch.device
    device_mesh: object | None = None  # torch DeviceMesh, None for a single process
    # each axis's group, looked up once: DeviceMesh.get_group searches every process group
    # on each call, and every collective and message asks for one
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, plan: Plan) -> "Mesh":
        shape = {"pp": plan.pp, "dp": plan.mesh_dp, "tp": plan.tp}
        device, _backend = device_for_backend()
        if device.type == "cuda":   # what the mesh's collectives and streams run on
            torch.cuda.set_device(device)
        if not dist.is_available() or not dist.is_initialized():
            plan.check_world_size(1)
            return cls(shape=shape, coords={a: 0 for a in AXES}, rank=0, device=device)
        plan.check_world_size(dist.get_world_size())
        from torch.distributed.device_mesh import init_device_mesh
        device_mesh = init_device_mesh(device.type, (plan.pp, plan.mesh_dp, plan.tp),
                                       mesh_dim_names=AXES)
        rank = dist.get_rank()
        coords = coordinates(rank_grid(plan.pp, plan.mesh_dp, plan.tp), rank)
        return cls(shape=shape, coords=coords, rank=rank, device=device, device_mesh=device_mesh)

    @property
    def world_size(self) -> int:
        return self.shape["pp"] * self.shape["dp"] * self.shape["tp"]

    def size(self, axis: str) -> int:
        return self.shape[_check_axis(axis)]

    def axis_rank(self, axis: str) -> int:
        """This rank's index inside its group along `axis`."""
        return self.coords[_check_axis(axis)]

    def group(self, axis: str):
        """The process group of the ranks that share every coordinate but `axis`'s.

        None where the axis needs no communication (a single process)."""
        _check_axis(axis)
        if self.device_mesh is None:
            return None
        if axis not in self._groups:
            self._groups[axis] = self.device_mesh.get_group(axis)
        return self._groups[axis]

    def global_rank(self, axis: str, axis_rank: int) -> int:
        """The global rank of the member `axis_rank` of this rank's group along `axis`:
        `rank_grid`'s layout (tp fastest) as arithmetic, no tensor made per message."""
        c = dict(self.coords, **{_check_axis(axis): axis_rank})
        return (c["pp"] * self.shape["dp"] + c["dp"]) * self.shape["tp"] + c["tp"]

    def __repr__(self) -> str:
        where = ", ".join(f"{a}={self.coords[a]}/{self.shape[a]}" for a in AXES)
        return f"Mesh(rank={self.rank}, {where}, device={self.device})"


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}")
    return axis
