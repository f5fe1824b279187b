"""The tensor-parallel collectives as autograd functions, on the mesh's tp axis.

Each function moves activations between the three ways a tp group can hold a tensor
(Megatron's "regions"):
- replicated: every tp rank holds the whole tensor (the input of a column-parallel layer);
- partial: every rank holds a summand of it (the output of a row-parallel layer, or of a
  vocab-parallel embedding, before the sum);
- split: every rank holds one slice along a dim (the sequence under sequence parallel, the
  features of a column-parallel output).
Each forward collective has its adjoint in backward: an all-reduce's adjoint is the
identity (and vice versa), an all-gather's is a reduce-scatter (and vice versa), a split's is
an all-gather. Every collective goes through the accounted `Comm` (tagged by the module it
serves and the direction, e.g. "blocks.0.mlp:forward"); a tp group of one short-circuits
(Comm communicates nothing, and the split and gather below are the identity).

[Note: in-place all-reduce]
`reduce_from_tp` sums the row-parallel matmul's fresh output in place, and `copy_to_tp`
sums in place the gradient that the following matmul(s) produced for it; neither tensor is
seen by anyone else, so no copy is made.

[Note: collectives are never compiled]
The six region functions below are `torch.compiler.disable`d: inside a compiled block
(strategies/compile.py) each is a graph break, so the collective runs eagerly through the
accounted Comm (counters, watchdog log) and its autograd function is recorded as it is in
eager mode; the compiled graphs are the matmuls and element-wise work between them.
"""
from __future__ import annotations

import torch

from meshtrain.core.comm import Comm

AXIS = "tp"


def _split(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's slice of `x` along `dim`, in its own storage (so the whole can be freed)."""
    n = comm.mesh.size(AXIS)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"cannot split a dim of {x.size(dim)} evenly over tp={n} ranks")
    size = x.size(dim) // n
    piece = x.narrow(dim, comm.mesh.axis_rank(AXIS) * size, size)
    return piece.clone(memory_format=torch.contiguous_format)


def _all_gather(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in tp-rank order."""
    if comm.mesh.size(AXIS) == 1:
        return x
    gathered, work = start_all_gather(x, comm, tag)
    work.wait()
    return arrange_gathered(gathered, x.shape, dim, comm.mesh.size(AXIS))


def start_all_gather(x: torch.Tensor, comm: Comm, tag: str):
    """Launch the all-gather of `x` over tp: (its flat output, in rank order; its handle).
    `arrange_gathered` makes the whole tensor of it once the handle has been waited."""
    flat = x.contiguous().reshape(-1)
    out = torch.empty(comm.mesh.size(AXIS) * flat.numel(), dtype=x.dtype, device=x.device)
    return out, comm.all_gather(out, flat, AXIS, tag=tag, async_op=True)


def arrange_gathered(out: torch.Tensor, shape: torch.Size, dim: int, n: int) -> torch.Tensor:
    """The n gathered pieces of `shape` laid side by side along `dim`."""
    dim = dim % len(shape)
    out = out.view(n, *shape).movedim(0, dim)                                 # (.., n, x[dim], ..)
    return out.reshape(*shape[:dim], n * shape[dim], *shape[dim + 1:])


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """This rank's slice along `dim` of the sum over tp of every rank's `x`."""
    n = comm.mesh.size(AXIS)
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.size(dim) % n:
        raise ValueError(f"cannot reduce-scatter a dim of {x.size(dim)} over tp={n} ranks")
    shape = (*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1:])
    chunks = x.reshape(shape).movedim(dim, 0).contiguous()              # (n, .., x[dim]/n, ..)
    out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks.view(-1), AXIS, tag=tag)
    return out.view(chunks.shape[1:])


class _CopyToTP(torch.autograd.Function):
    """Forward: the identity (the input is replicated). Backward: all-reduce the gradient
    (each rank's layer saw the whole input, so each holds a summand of its gradient)."""

    @staticmethod
    def forward(ctx, x, comm, tag):
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, AXIS, tag=f"{ctx.tag}:backward")
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum the partial outputs). Backward: the identity (the sum's
    gradient reaches every summand whole)."""

    @staticmethod
    def forward(ctx, x, comm, tag):
        x = x.contiguous()
        comm.all_reduce(x, AXIS, tag=f"{tag}:forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the slices along `dim` into the whole. Backward: keep this rank's
    slice of the gradient (no communication)."""

    @staticmethod
    def forward(ctx, x, comm, dim, tag):
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, f"{tag}:forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.comm, ctx.dim), None, None, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice along `dim` (no communication). Backward: all-gather
    the gradient slices into the whole gradient."""

    @staticmethod
    def forward(ctx, x, comm, dim, tag):
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _split(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, f"{ctx.tag}:backward"), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallel, entering a tensor-parallel region. Forward: all-gather the sequence
    slices into the whole sequence (replicated). Backward: reduce-scatter the gradient along
    the sequence (sum the ranks' summands, keep this rank's slice)."""

    @staticmethod
    def forward(ctx, x, comm, dim, tag):
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _all_gather(x, comm, dim, f"{tag}:forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, ctx.dim, f"{ctx.tag}:backward"), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallel, leaving a tensor-parallel region. Forward: reduce-scatter the
    partial outputs along the sequence. Backward: all-gather the gradient's sequence slices."""

    @staticmethod
    def forward(ctx, x, comm, dim, tag):
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _reduce_scatter(x, comm, dim, f"{tag}:forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, f"{ctx.tag}:backward"), None, None, None


# ---- the functions layers call ------------------------------------------------------------
@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    """Identity forward, all-reduce backward: enter a tensor-parallel region replicated."""
    return x if comm.mesh.size(AXIS) == 1 else _CopyToTP.apply(x, comm, tag)


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    """All-reduce forward, identity backward: leave a region by summing partial outputs."""
    return x if comm.mesh.size(AXIS) == 1 else _ReduceFromTP.apply(x, comm, tag)


@torch.compiler.disable
def gather_from_tp(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """All-gather along `dim` forward, split backward."""
    return x if comm.mesh.size(AXIS) == 1 else _GatherFromTP.apply(x, comm, dim, tag)


@torch.compiler.disable
def scatter_to_tp(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """Split along `dim` forward, all-gather backward."""
    return x if comm.mesh.size(AXIS) == 1 else _ScatterToTP.apply(x, comm, dim, tag)


@torch.compiler.disable
def gather_from_sequence(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward."""
    return x if comm.mesh.size(AXIS) == 1 else _GatherFromSequence.apply(x, comm, dim, tag)


@torch.compiler.disable
def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward."""
    if comm.mesh.size(AXIS) == 1:
        return x
    return _ReduceScatterToSequence.apply(x, comm, dim, tag)
