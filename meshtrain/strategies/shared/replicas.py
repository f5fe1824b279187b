"""Replicas that start equal: every data-parallel strategy (DDP, ZeRO, the parameter server)
begins from dp rank 0's parameters and buffers, so that one seed gives one model."""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.core.comm import Comm


def broadcast_tensors(tensors, comm: Comm, axis: str = "dp") -> None:
    """Make every replica along `axis` equal to axis rank 0's."""
    for tensor in tensors:
        comm.broadcast(tensor.data, src=0, axis=axis, tag="init")


@dataclass(frozen=True)
class ReplicaGroup:
    """Where a parameter is replicated over fewer ranks than the whole dp axis (an expert,
    over its expert-data-parallel group): the Comm and axis its gradient is reduced over
    and its value broadcast on. Gradients are still scaled by 1 / dp: the loss is the mean
    over the whole dp batch, and what the group sums already holds every dp rank's share
    (strategies/expert_parallel)."""
    comm: Comm
    axis: str

    @property
    def rank(self) -> int:
        return self.comm.mesh.axis_rank(self.axis)


def replica_groups(named: dict[str, object], replicas: dict[str, ReplicaGroup]
                   ) -> list[list]:
    """The parameters of `named` (in reverse order: backward's) that `replicas` places in
    the same group, one list per group: what never shares a bucket with the dp axis's."""
    out: dict[ReplicaGroup, list] = {}
    for name in reversed(list(named)):
        if name in replicas:
            out.setdefault(replicas[name], []).append(named[name])
    return list(out.values())
