"""Slot 2 for pp > 1: this rank keeps only its stages' layers (its chunks), under the full
model's parameter names.

[Note: tied weights across stages]
A parameter used by layers of several stages (a tied embedding and output layer) is found
by identity. Each rank holding it computes only its own layers' part of the gradient, so
after the data-parallel sync the holders exchange their parts and each adds them up in the
same (pp rank) order: the sum is bit-identical on every holder, and so is the weight after
the optimizer step. It is counted (gradient norm) on its first holder only.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import P2P, Comm
from meshtrain.core.plan import Plan
from meshtrain.core.state import StateLayout
from meshtrain.strategies.pipeline.partition import model_layers, stage_bounds
from meshtrain.strategies.pipeline.schedules import stage_of


class PipelineStages:
    """Stages protocol (strategies/slots.py): chunk c of this rank is stage c*pp + rank."""

    def __init__(self, model: nn.Module, plan: Plan, comm: Comm, layout: StateLayout,
                 cuts: list[int] | None = None) -> None:
        self.model, self.comm = model, comm
        self.pp, self.rank = plan.pp, comm.mesh.axis_rank("pp")
        layers = model_layers(model)
        self.bounds = stage_bounds(model, plan, cuts)
        self.stages = len(self.bounds) - 1
        self.chunks = [nn.Sequential(*layers[self.bounds[s]:self.bounds[s + 1]])
                       for s in (stage_of(self.rank, c, plan.pp)
                                 for c in range(plan.virtual_stages))]
        name_of = _canonical_names(model, layout)
        holders: dict[int, set[int]] = {}
        for s in range(self.stages):
            for layer in layers[self.bounds[s]:self.bounds[s + 1]]:
                for p in layer.parameters():
                    holders.setdefault(id(p), set()).add(s % plan.pp)
        mine = {id(p) for chunk in self.chunks for p in chunk.parameters()}
        order = {n: i for i, n in enumerate(layout.parameters)}
        self._params = sorted(((name_of[id(p)], p) for p in _unique(self.chunks, "parameters")),
                              key=lambda item: order[item[0]])
        self._buffers = [(name_of[id(b)], b) for b in _unique(self.chunks, "buffers")
                         if id(b) in name_of]
        self.shared = {name_of[i]: sorted(ranks) for i, ranks in holders.items()
                       if len(ranks) > 1}
        # non-persistent buffers (RoPE's inv_freq) stay on every stage that runs them
        _release_others(model, mine | {id(b) for b in _unique(self.chunks, "buffers")})

    # ---- what this rank holds -----------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._params)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._buffers)

    def modules(self) -> list[nn.Module]:
        return list(self.chunks)

    def counts(self, name: str) -> bool:
        return name not in self.shared or self.shared[name][0] == self.rank

    # ---- tied weights ------------------------------------------------------------------------
    def sum_shared_gradients(self, reduced: Callable[[str], torch.Tensor | None]) -> None:
        """See [Note: tied weights across stages]."""
        for match, name in enumerate(sorted(self.shared)):
            holders = self.shared[name]
            grad = reduced(name) if self.rank in holders else None
            if grad is None:   # not here, or no part of it at this dp coordinate
                continue
            mine = grad.detach().clone()
            parts = {h: torch.empty_like(mine) for h in holders if h != self.rank}
            ops = [P2P(mine, h, send=True, match=match) for h in parts]
            ops += [P2P(t, h, send=False, match=match) for h, t in parts.items()]
            for work in self.comm.batch_isend_irecv(ops, "pp", tag="shared"):
                work.wait()
            parts[self.rank] = mine
            total = parts[holders[0]].clone()
            for h in holders[1:]:
                total += parts[h]
            grad.copy_(total)

    # ---- consolidation -------------------------------------------------------------------------
    def merge(self, local: dict[str, object]) -> dict[str, object]:
        """Every stage's entries on every rank: the shapes travel first (as JSON), then
        each entry is broadcast over pp from the first stage holding it."""
        described = self.comm.gather_objects({n: _describe(v) for n, v in local.items()},
                                             tag="merge")
        out: dict[str, object] = {}
        for src in range(self.pp):
            theirs = described[self.comm.mesh.global_rank("pp", src)]
            for name, desc in theirs.items():
                if name in out:
                    continue
                value = local[name] if src == self.rank else _empty(desc, self.comm.mesh.device)
                out[name] = _broadcast(value, desc, src, self.comm)
        return out


def keep_stages(model: nn.Module, plan: Plan, comm: Comm, layout: StateLayout,
                cuts: list[int] | None = None) -> PipelineStages:
    return PipelineStages(model, plan, comm, layout, cuts)


def _canonical_names(model: nn.Module, layout: StateLayout) -> dict[int, str]:
    return {id(t): layout.canonical[k] for k, t in model.state_dict(keep_vars=True).items()}


def _unique(chunks: list[nn.Module], what: str) -> list[torch.Tensor]:
    seen, out = set(), []
    for chunk in chunks:
        for t in getattr(chunk, what)():
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _release_others(model: nn.Module, keep: set[int]) -> None:
    """Other stages' parameters and buffers become meta tensors (shape, no storage): this
    rank's memory holds its own stages only."""
    for module in model.modules():
        for slot in (module._parameters, module._buffers):
            for name, t in slot.items():
                if t is not None and id(t) not in keep:
                    meta = torch.empty_like(t, device="meta")
                    slot[name] = (nn.Parameter(meta, requires_grad=t.requires_grad)
                                  if isinstance(t, nn.Parameter) else meta)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "host": value.device.type == "cpu"}
    if isinstance(value, dict):
        return {"dict": {k: _describe(v) for k, v in value.items()}}
    return {"value": value}


def _empty(desc, device):
    if "shape" in desc:
        return torch.empty(desc["shape"], dtype=getattr(torch, desc["dtype"]), device=device)
    if "dict" in desc:
        return {k: _empty(v, device) for k, v in desc["dict"].items()}
    return desc["value"]


def _broadcast(value, desc, src: int, comm: Comm):
    """The entry from `src`, on every rank where `src` kept it: a host tensor (AdamW's step
    count, an offloaded state) crosses the group on the mesh's device (NCCL takes no host
    tensor) and lands on the host again."""
    if isinstance(value, torch.Tensor):
        wire = value.detach().to(comm.mesh.device).contiguous()
        comm.broadcast(wire, src, "pp", tag="merge")
        return wire.cpu() if desc.get("host") else wire
    if isinstance(value, dict):
        return {k: _broadcast(v, desc["dict"][k], src, comm) for k, v in value.items()}
    return value
