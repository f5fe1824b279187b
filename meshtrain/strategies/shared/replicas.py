"""Replicas that start equal: every data-parallel strategy (DDP, ZeRO, the parameter server)
begins from dp rank 0's parameters and buffers, so that one seed gives one model."""
from __future__ import annotations

from meshtrain.core.comm import Comm


def broadcast_tensors(tensors, comm: Comm, axis: str = "dp") -> None:
    """Make every replica along `axis` equal to axis rank 0's."""
    for tensor in tensors:
        comm.broadcast(tensor.data, src=0, axis=axis, tag="init")
