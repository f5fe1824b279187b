"""Sequence parallel's column-parallel matmuls as Megatron-LM runs them (Korthikanti et al.
2022 §4.2.2): keep this rank's sequence slice for backward, never the gathered sequence.

Under sequence parallel a tensor-parallel region is entered by `gather_from_sequence`: the
slice X_r (B, S/T, h) is all-gathered into X (B, S, h), which the region's column-parallel
layers read (q, k and v share one X; the MLP's fc has its own). Each computes Y = X·A + b.
Its weight gradient dA = Xᵀ·dY needs X again in backward; autograd would keep X alive from
forward to backward, T times the slice. `linear_on_gathered` keeps X_r instead and
all-gathers it again in backward (Megatron's LinearWithGradAccumulationAndAsyncCommunication):
the gather is started before the input gradient dX = dY·Aᵀ is computed and waited for just
before dA, so it overlaps that matmul. The layers that read one X share that one regather
(`Regather`): the first of them to run backward starts it, the last lets it go.
dX goes back through `gather_from_sequence`, whose backward reduce-scatters the sum of the
readers' dX: the collectives of forward and of the input gradient are unchanged, and each
region adds one all-gather of X per micro-batch in backward (tagged "<region>:regather").
"""
from __future__ import annotations

import torch

from meshtrain.core.comm import Comm
from meshtrain.strategies.tensor_parallel.communications import (AXIS, arrange_gathered,
                                                                  start_all_gather)


class Regather:
    """The whole X of one forward's gather, rebuilt in backward from the slice that its
    readers saved: started by the first reader's backward, shared by the others, dropped
    when the last is done. Holds no tensor between forward and backward (recomputation must
    be able to drop the slice), only the count of readers."""

    def __init__(self, comm: Comm, dim: int, tag: str) -> None:
        self.comm, self.dim, self.tag = comm, dim, tag
        self.readers = 0
        self._pending: tuple | None = None      # (flat output, handle) while in flight
        self._whole: torch.Tensor | None = None

    def start(self, piece: torch.Tensor) -> None:
        if self._whole is None and self._pending is None:
            self._pending = start_all_gather(piece, self.comm, f"{self.tag}:regather")

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        if self._whole is None:
            self.start(piece)
            out, work = self._pending
            work.wait()
            self._whole = arrange_gathered(out, piece.shape, self.dim,
                                           self.comm.mesh.size(AXIS))
            self._pending = None
        return self._whole

    def release(self) -> None:
        """One reader is done. (A reader that runs backward twice, as zero bubble's split
        passes do, makes the next one gather again: more bytes, the same numbers.)"""
        self.readers -= 1
        if self.readers <= 0:
            self._whole = self._pending = None


class _LinearOnGathered(torch.autograd.Function):
    """Forward: Y = X·Aᵀ + b (nn.Linear's (out, in) A) or X·A + b (Conv1D's (in, out)) on
    the gathered X, saving only this rank's slice of it. Backward: all-gather the slice again
    (overlapping dX's matmul), dX = dY·A (or dY·Aᵀ), dA = dYᵀ·X (or Xᵀ·dY), db = Σ dY.
    `float8` (strategies/float8.SplitFloat8, nn.Linear's layout): the three products in
    float8, X regathered in bf16 and cast again with forward's scale."""

    @staticmethod
    def forward(ctx, x, piece, regather, weight, bias, conv1d, float8):
        ctx.regather, ctx.conv1d, ctx.has_bias = regather, conv1d, bias is not None
        ctx.float8 = float8
        ctx.save_for_backward(piece, weight)
        regather.readers += 1
        x2 = x.reshape(-1, x.size(-1))                                # (tokens, in)
        if float8 is not None:
            y, ctx.scales = float8.forward(x2, weight)                # (tokens, out)
        else:
            y = x2 @ (weight if conv1d else weight.t())               # (tokens, out)
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], y.size(-1))

    @staticmethod
    def backward(ctx, grad):
        piece, weight = ctx.saved_tensors
        regather, need_x, f8 = ctx.regather, ctx.needs_input_grad[3], ctx.float8
        if need_x:
            regather.start(piece)             # in flight while dX is computed
        g = grad.reshape(-1, grad.size(-1))                             # (tokens, out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            if f8 is not None:
                grad_x = f8.grad_input(g, weight, ctx.scales)
            else:
                grad_x = g @ (weight.t() if ctx.conv1d else weight)     # (tokens, in)
            grad_x = grad_x.view(*grad.shape[:-1], grad_x.size(-1))
        grad_w = grad_b = None
        if need_x:
            x = regather.whole(piece)
            x = x.reshape(-1, x.size(-1))                               # (tokens, in)
            if f8 is not None:
                grad_w = f8.grad_weight(g, x, ctx.scales)
            else:
                grad_w = x.t() @ g if ctx.conv1d else g.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_b = g.sum(0)
        regather.release()
        return grad_x, None, None, grad_w, grad_b, None, None


def linear_on_gathered(x: torch.Tensor, piece: torch.Tensor, regather: Regather,
                       weight: torch.Tensor, bias: torch.Tensor | None,
                       conv1d: bool, float8=None) -> torch.Tensor:
    """A column-parallel matmul on `x`, the whole sequence gathered from `piece` (this rank's
    slice), that saves `piece` for backward and not `x`; in float8 where `float8` is given."""
    return _LinearOnGathered.apply(x, piece, regather, weight, bias, conv1d, float8)
