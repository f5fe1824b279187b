"""All-to-all attention (DeepSpeed Ulysses' style): heads scattered, the sequence gathered.

    (B, H, 2c, D) on each of cp ranks  --all-to-all-->  (B, H/cp, T, D): a head group, whole
    attention per head over the whole sequence, locally  --all-to-all-->  (B, H, 2c, D)

The gathered sequence arrives in rank order (rank j's chunks j and 2cp-1-j), so it is put
in sequence order before the causal attention and back after. Each all-to-all's backward
is the other one. The heads (and, under GQA, the K/V heads, which travel as they are) must
divide by cp. A sliding window narrower than the sequence, or soft-capped scores, run the
ring's tiled kernel on the gathered sequence (tiles.py: only the tiles in the window).

Bytes sent per rank per layer: (cp-1)/cp of q, k, v and the output in forward, and as much
for their gradients in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.core.comm import Comm
from meshtrain.strategies.context_parallel.layout import ChunkLayout
from meshtrain.strategies.context_parallel.ring import local_attention
from meshtrain.strategies.context_parallel.tiles import Scoring

AXIS = "cp"


def all_to_all_attention(q, k, v, comm: Comm, layout: ChunkLayout, scale: float,
                         window: int | None = None, softcap: float | None = None):
    """Causal attention of this rank's queries over the whole sequence.
    q (B, H, 2c, D), k and v (B, Hkv, 2c, D), cp dividing H and Hkv -> (B, H, 2c, D);
    `window`: keys a query sees (sliding-window attention), `softcap`: scores capped."""
    order = _sequence_order(layout, q.size(2), q.device)
    q, k, v = (_Exchange.apply(t, comm, _scatter_heads, _gather_heads)[:, :, order]
               for t in (q, k, v))
    scoring = Scoring(scale, window, softcap).within(q.size(2))
    if scoring.window is None and scoring.softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=q.size(1) != k.size(1))
    else:   # SDPA has no cap, and a band mask would be T x T: the ring's tiles, locally
        out = local_attention(q, k, v, scoring)
    undo = torch.empty_like(order)
    undo[order] = torch.arange(order.numel(), device=order.device)
    return _Exchange.apply(out[:, :, undo], comm, _gather_heads, _scatter_heads)


def _sequence_order(layout: ChunkLayout, local_len: int, device) -> torch.Tensor:
    """Indices into the gathered sequence (rank 0's tokens, rank 1's, ...) that put it in
    sequence order."""
    places = torch.cat([ChunkLayout(r, layout.size).positions(local_len, device)
                        for r in range(layout.size)])
    return places.argsort()


def _scatter_heads(x, comm: Comm):
    """(B, H, L, D) -> (B, H/cp, cp L, D): this rank's head group, every rank's tokens."""
    n = comm.mesh.size(AXIS)
    B, H, L, D = x.shape
    send = x.view(B, n, H // n, L, D).transpose(0, 1).contiguous()   # (cp, B, H/cp, L, D)
    received = torch.empty_like(send)                                # row j: rank j's tokens
    comm.all_to_all(received, send, AXIS, tag="cp-a2a")
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * L, D)


def _gather_heads(x, comm: Comm):
    """(B, H/cp, cp L, D) -> (B, H, L, D): the reverse of `_scatter_heads`."""
    n = comm.mesh.size(AXIS)
    B, h, T, D = x.shape
    send = x.view(B, h, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()   # (cp, B, h, L, D)
    received = torch.empty_like(send)                                      # row j: heads j
    comm.all_to_all(received, send, AXIS, tag="cp-a2a")
    # laid out (B, L, H, D), as SDPA lays its output: merging the heads is then a view
    return received.permute(1, 3, 0, 2, 4).reshape(B, T // n, n * h, D).transpose(1, 2)


class _Exchange(torch.autograd.Function):
    """`there` in forward and its inverse `back` in backward: each all-to-all's gradient is
    the other all-to-all of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm, there, back):
        ctx.comm, ctx.back = comm, back
        return there(x.contiguous(), comm)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.comm), None, None, None
