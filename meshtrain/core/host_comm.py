"""`Comm.on_host()`: meshtrain's accounted communication over gloo groups of the mesh's ranks,
for traffic that is a host concept (a parameter server). On CUDA the mesh's groups are NCCL,
which takes no host tensor, ignores tags and shares one stream per peer for sends and
receives: a parameter server's receives, posted per peer and waiting for whichever message
comes next, need gloo's tagged, thread-safe point-to-point instead. CUDA tensors cross these
groups staged through host memory (see [Note: devices and backends] in comm.py).
"""
from __future__ import annotations

import torch.distributed as dist

from meshtrain.core.comm import Comm
from meshtrain.core.mesh import AXES, Mesh, axis_groups, rank_grid


class HostComm(Comm):
    """`Comm.on_host()`: the same accounting over gloo groups."""

    def __init__(self, comm: Comm) -> None:
        self._base = comm
        super().__init__(comm.mesh, comm.stats)
        self.log = comm.log
        self._groups = {axis: gloo_group(comm.mesh, axis) for axis in AXES}
        if comm.mesh.size("cp") > 1:   # the replica axis (core/mesh.py) where it is its own
            self._groups["dp_cp"] = gloo_group(comm.mesh, "dp_cp")

    @property
    def link(self):
        """The base Comm's emulated link, even one set after this was made."""
        return self._base.link

    @link.setter
    def link(self, value) -> None:   # Comm.__init__ sets None; the base Comm owns the link
        pass

    def group(self, axis: str):
        return self._groups[axis]

    def on_host(self) -> "Comm":
        return self


def gloo_group(mesh: Mesh, axis: str):
    """A gloo group over the ranks of this rank's `axis` group (its own, if gloo already).
    new_group is collective over the world: every rank creates every group of the axis, in
    the same order, and keeps its own."""
    group = mesh.group(axis)
    if group is None or dist.get_backend(group) == "gloo":
        return group
    mine = None
    for row in axis_groups(rank_grid(*(mesh.shape[a] for a in AXES)), axis):
        made = dist.new_group(row, backend="gloo")
        if mesh.rank in row:
            mine = made
    return mine
