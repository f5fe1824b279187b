"""A model whose layers take a fixed wall time: forward, input gradient and weight gradient
each cost a given time per layer (the same by default), whatever the data. It makes a
pipeline's timeline measurable against theory (every stage costs the same; F = B = W as in
the zero-bubble paper).

Each layer is y = Wait(x) * Wait'(scale): the input's path (forward and input gradient) and
the weight's path (weight gradient) are separate autograd nodes, so a backward split into B
and W (zb-h1) pays each cost where it belongs, and a whole backward pays both.

The wait sleeps, then busy-waits the last fraction of a millisecond: sleeping makes the cost
a wall time that does not depend on getting a CPU (the tests run more ranks than cores), the
short spin makes it precise (a sleep overshoots by ~0.1 ms).
"""
from __future__ import annotations

import time

import torch
from torch import nn

_SPIN = 3e-4   # the busy-waited tail, seconds


def wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    if seconds > _SPIN:
        time.sleep(seconds - _SPIN)
    while time.perf_counter() < end:
        pass


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        wait(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait(ctx.backward_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, weight_s):
        ctx.weight_s = weight_s
        return scale.clone()

    @staticmethod
    def backward(ctx, grad):
        wait(ctx.weight_s)
        return grad, None


class SpinLayer(nn.Module):
    def __init__(self, seconds: float, input_s: float | None = None,
                 weight_s: float | None = None) -> None:
        super().__init__()
        self.forward_s = seconds
        self.input_s = seconds if input_s is None else input_s
        self.weight_s = seconds if weight_s is None else weight_s
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_InputPath.apply(x, self.forward_s, self.input_s)
                * _WeightPath.apply(self.scale, self.weight_s))


def spin_pipe(layers: int, seconds: float, input_s: float | None = None,
              weight_s: float | None = None) -> nn.Sequential:
    """`layers` SpinLayers on (B, width) floats, one per pipeline stage (or chunk): forward
    `seconds`, input gradient `input_s`, weight gradient `weight_s` (both default
    `seconds`)."""
    return nn.Sequential(*[SpinLayer(seconds, input_s, weight_s) for _ in range(layers)])
