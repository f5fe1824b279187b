"""Slot 1 over the ep axis: each MoE layer's packed experts split along their first dim.

`ExpertParallel` implements the `LayerSharding` protocol (strategies/slots.py): a rank's
experts made whole (an all-gather over ep, for the consolidated state) and cut back (a
slice), the loss unchanged. It also says which parameters are not replicated over the whole
dp axis (`replicas`: the experts, replicated over their edp group only), for the gradient
sync to reduce each over its own group, and counts what the dispatch routed.
"""
from __future__ import annotations

from typing import Callable

import torch

from meshtrain.core.comm import Comm
from meshtrain.core.regions import Region, slice_along
from meshtrain.strategies.expert_parallel.dispatch import ShardedExperts
from meshtrain.strategies.shared.replicas import ReplicaGroup


class ExpertParallel:
    """`layers`: the ShardedExperts of each MoE layer, by module name, in model order;
    `inner`: the LayerSharding of every other tensor (tensor parallel's, or none's)."""

    def __init__(self, layers: dict[str, ShardedExperts], comm: Comm, dp_comm: Comm,
                 inner) -> None:
        self.layers, self.comm, self.dp_comm, self.inner = layers, comm, dp_comm, inner
        self.ep = comm.mesh.size("ep")
        self.experts = {f"{name}.{p}" for name in layers for p in ("gate_up_proj", "down_proj")}
        edp = ReplicaGroup(comm, "edp")
        self.replicas = {name: edp for name in self.experts}

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Every ep rank's experts, in rank order (collective over ep for expert tensors)."""
        if name not in self.experts:
            return self.inner.full(name, local)
        whole = local.new_empty((self.ep * local.shape[0], *local.shape[1:]))
        self.comm.all_gather(whole, local.contiguous(), "ep", tag="ep-state")
        return whole

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name not in self.experts:
            return self.inner.local(name, full)
        rows = full.shape[0] // self.ep
        return full.narrow(0, self.comm.mesh.axis_rank("ep") * rows, rows)

    def region(self, name: str, shape: tuple[int, ...]) -> Region:
        if name not in self.experts:
            return self.inner.region(name, shape)
        rows = shape[0] // self.ep
        return slice_along(shape, 0, self.comm.mesh.axis_rank("ep") * rows, rows)

    def cuts(self, name: str, shape: tuple[int, ...]) -> list[list[int]]:
        if name not in self.experts:
            return self.inner.cuts(name, shape)
        return [list(range(0, shape[0], shape[0] // self.ep)), *([] for _ in shape[1:])]

    def counts(self, name: str) -> bool:
        return self.inner.counts(name)   # experts are whole over tp: replicated there

    def sum_partial_gradients(self, reduced: Callable) -> None:
        self.inner.sum_partial_gradients(reduced)   # an expert's gradient is whole

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        return self.inner.wrap_loss(loss_fn)

    def routed(self) -> dict[str, torch.Tensor]:
        """What the dispatch routed since the last call, this rank's tokens, summed over
        the MoE layers: "sent" rows to each ep rank (ep,), "per_expert" rows to each expert
        (E,); and "layer_sent" (layers, ep) per layer."""
        taken = [layer.take_counts() for layer in self.layers.values()]
        layer_sent = torch.stack([sent for sent, _ in taken])
        layer_experts = torch.stack([e for _, e in taken])
        return {"sent": layer_sent.sum(dim=0), "layer_sent": layer_sent,
                "per_expert": layer_experts.sum(dim=0), "layer_per_expert": layer_experts}

    def expert_load(self) -> dict:
        """Rows each expert of each MoE layer received since the last call, over the global
        batch (collective over dp), and the imbalance: the largest max / mean of a layer
        (1.0: perfectly balanced; the slowest expert sets an ep step's pace)."""
        tokens = self.routed()["layer_per_expert"].to(self.comm.mesh.device, torch.float64)
        self.dp_comm.all_reduce(tokens, "dp", tag="expert-load")
        self.dp_comm.all_reduce(tokens, "pp", tag="expert-load")   # zeros: others' layers
        mean = tokens.mean(dim=1).clamp(min=1)
        return {"expert_tokens": tokens.long().tolist(),
                "expert_imbalance": (tokens.max(dim=1).values / mean).max().item()}
