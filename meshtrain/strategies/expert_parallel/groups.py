"""The expert-parallel groups, carved out of the data-parallel ones (core/mesh.py builds the
mesh's axes; these two live here, beside the one strategy that uses them).

Each dp group of D ranks (dp ranks 0..D-1) splits two ways for ep = E:

    ep group   dp ranks [g*E, (g+1)*E)   contiguous, as Megatron places them: the all-to-all's
                                         ranks are neighbours (one node where dp is laid out so)
    edp group  dp ranks r with r % E == k  the ranks that hold the same experts (k's), over
                                          which those experts' gradients are reduced

so dp rank r has ep rank r % E and edp rank r // E. `ep_groups` / `edp_groups` are the pure
layout (testable with no processes); `SubMesh` wraps the process groups in the shape
`core.comm.Comm` reads (size, axis_rank, group, global_rank), so every collective over them is
counted by the same `CommStats` under the axes "ep" and "edp".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.core.comm import Comm
from meshtrain.core.mesh import axis_groups, rank_grid

EP_AXES = ("ep", "edp")


def ep_groups(dp_ranks: list[int], ep: int) -> list[list[int]]:
    """The ep groups of one dp group (global ranks, in dp order): contiguous runs of `ep`."""
    return [dp_ranks[i:i + ep] for i in range(0, len(dp_ranks), ep)]


def edp_groups(dp_ranks: list[int], ep: int) -> list[list[int]]:
    """The expert-data-parallel groups of one dp group: every ep-th rank, from each offset."""
    return [dp_ranks[k::ep] for k in range(ep)]


@dataclass
class SubMesh:
    """Two axes over subsets of the dp ranks, in the interface Comm uses of a Mesh."""
    shape: dict[str, int]
    coords: dict[str, int]
    members: dict[str, list[int]]     # axis -> this rank's group, global ranks in axis order
    groups: dict[str, object]         # axis -> its process group
    rank: int
    device: torch.device
    device_mesh: object | None = None   # Comm checks devices only on the mesh's own axes

    @property
    def world_size(self) -> int:
        return self.shape["ep"] * self.shape["edp"]

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def axis_rank(self, axis: str) -> int:
        return self.coords[axis]

    def group(self, axis: str):
        return self.groups[axis]

    def global_rank(self, axis: str, axis_rank: int) -> int:
        return self.members[axis][axis_rank]


def expert_comm(comm: Comm, ep: int) -> Comm:
    """A Comm over this rank's ep and edp groups, sharing `comm`'s counters and log.
    Collective: every rank of the world creates every group, in the same order."""
    mesh = comm.mesh
    dp, rank = mesh.size("dp"), mesh.rank
    members, groups = {}, {}
    if dist.is_available() and dist.is_initialized():
        grid = rank_grid(mesh.size("pp"), dp, mesh.size("cp"), mesh.size("tp"))
        for dp_ranks in axis_groups(grid, "dp"):
            for axis, layout in (("ep", ep_groups), ("edp", edp_groups)):
                for ranks in layout(dp_ranks, ep):
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        members[axis], groups[axis] = ranks, group
    else:   # one process: ep = dp = 1
        members = {"ep": [rank], "edp": [rank]}
        groups = {"ep": None, "edp": None}
    r = mesh.axis_rank("dp")
    sub = SubMesh(shape={"ep": ep, "edp": dp // ep}, coords={"ep": r % ep, "edp": r // ep},
                  members=members, groups=groups, rank=rank, device=mesh.device)
    out = Comm(sub, stats=comm.stats)
    out.log = comm.log   # one call sequence per rank for the watchdog to compare
    return out
