"""A mixture of experts' routing carried through pipeline stages (models/moe.py's [Note:
routing carried through pipeline stages]): each stage reads its own MoE layers' router
logits and adds their sums to the vector [counts (E + 1), prob_sum (E)] that rides beside
the hidden state, so that the last stage computes the load-balancing loss over every layer.

The logits are read where transformers records them (`_can_record_outputs["router_logits"]`:
the router module's output): a forward hook on each router, registered once per model,
that keeps what the routers output only while a stage element runs its layer. A layer run
again by recomputation (during backward) is not recorded twice; the sums are computed
after the layer returns, outside any checkpointed region.

meshtrain's GPT with experts keeps each block's router logits itself (models/gpt_moe.py's
MoEFeedForward, not kept when a recomputation runs it again): `routed_gpt_layers` gives its
pipeline layers, [embed, *blocks, head] each wrapped to pass (hidden, routing) on.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from meshtrain.models.gpt import GPT
from meshtrain.models.moe import Router, layer_routing, router_of, router_recorder

_TAP = "_meshtrain_router_tap"


class RouterTap:
    """The router logits of the layer a stage element is running."""

    def __init__(self, model: nn.Module, router: Router) -> None:
        self.router = router
        self._recording: list[torch.Tensor] | None = None
        target, self.index = router_recorder(model)
        for module in model.modules():
            if isinstance(module, target):
                module.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self._recording is not None:
            self._recording.append(output[self.index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self):
        kept: list[torch.Tensor] = []
        self._recording = kept
        try:
            yield kept
        finally:
            self._recording = None

    def start(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the first stage sends beside its hidden state: no routing yet."""
        return torch.zeros(2 * self.router.experts + 1, dtype=torch.float32,
                           device=hidden.device)

    def add(self, routing: torch.Tensor, logits: list[torch.Tensor]) -> torch.Tensor:
        """`routing` plus the sums of the layers whose router `logits` were recorded."""
        for layer in logits:
            counts, prob_sum = layer_routing(layer, self.router)
            routing = routing + torch.cat([counts, prob_sum])
        return routing


def router_tap(model: nn.Module) -> RouterTap | None:
    """The model's tap where its config asks for the router's loss (None otherwise): made
    once, since the stage elements are built more than once."""
    router = router_of(model)
    if router is None or router.aux_coef is None:
        return None
    tap = model.__dict__.get(_TAP)
    if tap is None:
        tap = RouterTap(model, router)
        model.__dict__[_TAP] = tap
    return tap


class Routed(NamedTuple):
    """The last stage's output under a carried routing: the logits (what the loss functions
    read, `.logits`) and the totals (`.routing`, what models/moe.RouterLoss reads). A tuple,
    so that the pipeline sees its tensors (zero bubble's weight pass starts from them)."""
    logits: torch.Tensor
    routing: torch.Tensor


def routed_gpt_layers(model: nn.Module) -> list[nn.Module] | None:
    """A GPT with experts whose router's loss is on: its pipeline layers passing the routing
    sums beside the hidden state; None for any other model (its own layers serve)."""
    router = router_of(model) if isinstance(model, GPT) else None
    if router is None or router.aux_coef is None:
        return None
    return [_GPTStart(model.embed, router), *(_GPTBlock(b, router) for b in model.blocks),
            _GPTEnd(model.head)]


class _GPTStart(nn.Module):
    def __init__(self, embed: nn.Module, router: Router) -> None:
        super().__init__()
        self.embed, self.width = embed, 2 * router.experts + 1

    def forward(self, idx: torch.Tensor):
        hidden = self.embed(idx)
        return hidden, torch.zeros(self.width, dtype=torch.float32, device=hidden.device)


class _GPTBlock(nn.Module):
    def __init__(self, block: nn.Module, router: Router) -> None:
        super().__init__()
        self.block, self.router = block, router

    def forward(self, x):
        hidden, routing = x
        hidden = self.block(hidden)
        counts, prob_sum = layer_routing(self.block.mlp.take_router_logits(), self.router)
        return hidden, routing + torch.cat([counts, prob_sum])


class _GPTEnd(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x) -> Routed:
        hidden, routing = x
        return Routed(self.head(hidden), routing)
