"""The device mesh: every rank is a coordinate (pp, dp, cp, tp), tp varying fastest.

The layout is a pure function (`rank_grid`, `axis_groups`) testable with no processes;
`Mesh` wraps `torch.distributed.device_mesh.DeviceMesh` over that same layout and is passed
explicitly to every strategy (never a global). An "axis" is a mesh dimension; a "dim" is a
tensor dimension.

tp varies fastest so that a tensor-parallel group (the most talkative) is a run of
consecutive ranks, which torchrun places on one node; cp (context parallel, as talkative:
a ring exchange per attention layer) sits next to it.

[Note: the replica axis]
Parameters are replicated over dp and over cp (every cp rank holds the whole layer and
sees other tokens of the same sequences), so gradients are reduced, and ZeRO shards, over
dp x cp: the flattened axis "dp_cp" (rank dp*cp_size + cp), as Megatron folds cp into data
parallel. `Mesh.replica_axis` names the one to use: "dp" where cp = 1, else "dp_cp".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.core.device import backend_for, rank_device
from meshtrain.core.plan import Plan

AXES = ("pp", "dp", "cp", "tp")
FLATTENED = {"dp_cp": ("dp", "cp")}
"""Axes made of adjacent axes of AXES, ranked in row-major order over them."""
GROUP_AXES = AXES + tuple(FLATTENED)


def rank_grid(pp: int, dp: int, cp: int, tp: int) -> torch.Tensor:
    """All ranks as a tensor shaped (pp, dp, cp, tp): grid[i, j, c, k] is the rank there."""
    return torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)


def axis_groups(grid: torch.Tensor, axis: str) -> list[list[int]]:
    """The groups of an axis: each is the ranks that vary along `axis` (or along every axis
    a flattened one joins, the first slowest), the others fixed."""
    dims = [AXES.index(a) for a in FLATTENED.get(_check_axis(axis), (axis,))]
    moved = grid.movedim(dims, list(range(-len(dims), 0)))  # (..., *axes)
    size = 1
    for d in dims:
        size *= grid.shape[d]
    return moved.reshape(-1, size).tolist()


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
    flat_meshes: dict | None = None    # flattened axis -> its 1-D DeviceMesh
    # each axis's group, looked up once: DeviceMesh.get_group searches every process group
    # on each call, and every collective and message asks for one
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, plan: Plan) -> "Mesh":
        shape = {"pp": plan.pp, "dp": plan.mesh_dp, "cp": plan.cp, "tp": plan.tp}
        device, _backend = device_for_backend()
        if device.type == "cuda":   # what the mesh's collectives and streams run on
            torch.cuda.set_device(device)
        if not dist.is_available() or not dist.is_initialized():
            plan.check_world_size(1)
            return cls(shape=shape, coords={a: 0 for a in AXES}, rank=0, device=device)
        plan.check_world_size(dist.get_world_size())
        from torch.distributed.device_mesh import init_device_mesh
        device_mesh = init_device_mesh(device.type, tuple(shape[a] for a in AXES),
                                       mesh_dim_names=AXES)
        # the flattened groups only where they differ from dp's (collective: every rank)
        flat = ({name: device_mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}
                if plan.cp > 1 else {})
        rank = dist.get_rank()
        coords = coordinates(rank_grid(*(shape[a] for a in AXES)), rank)
        return cls(shape=shape, coords=coords, rank=rank, device=device,
                   device_mesh=device_mesh, flat_meshes=flat)

    @property
    def world_size(self) -> int:
        return self.shape["pp"] * self.shape["dp"] * self.shape["cp"] * self.shape["tp"]

    @property
    def replica_axis(self) -> str:
        """The axis parameters are replicated over, which gradients are reduced and ZeRO
        shards over: see [Note: the replica axis]."""
        return "dp" if self.shape["cp"] == 1 else "dp_cp"

    def size(self, axis: str) -> int:
        size = 1
        for part in FLATTENED.get(_check_axis(axis), (axis,)):
            size *= self.shape[part]
        return size

    def axis_rank(self, axis: str) -> int:
        """This rank's index inside its group along `axis`."""
        index = 0
        for part in FLATTENED.get(_check_axis(axis), (axis,)):
            index = index * self.shape[part] + self.coords[part]
        return index

    def group(self, axis: str):
        """The process group of the ranks that share every coordinate but `axis`'s.

        None where the axis needs no communication (a single process)."""
        _check_axis(axis)
        if self.device_mesh is None:
            return None
        if axis not in self._groups:
            self._groups[axis] = self._find_group(axis)
        return self._groups[axis]

    def _find_group(self, axis: str):
        if axis in FLATTENED:
            if axis not in self.flat_meshes:   # dp x 1: the dp group itself
                return self.device_mesh.get_group(FLATTENED[axis][0])
            return self.flat_meshes[axis].get_group()
        return self.device_mesh.get_group(axis)

    def global_rank(self, axis: str, axis_rank: int) -> int:
        """The global rank of the member `axis_rank` of this rank's group along `axis`:
        `rank_grid`'s layout (tp fastest) as arithmetic, no tensor made per message."""
        coords = dict(self.coords)
        for part in reversed(FLATTENED.get(_check_axis(axis), (axis,))):
            axis_rank, coords[part] = divmod(axis_rank, self.shape[part])
        rank = 0
        for a in AXES:
            rank = rank * self.shape[a] + coords[a]
        return rank

    def __repr__(self) -> str:
        where = ", ".join(f"{a}={self.coords[a]}/{self.shape[a]}" for a in AXES)
        return f"Mesh(rank={self.rank}, {where}, device={self.device})"


def _check_axis(axis: str) -> str:
    if axis not in GROUP_AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {GROUP_AXES}")
    return axis
