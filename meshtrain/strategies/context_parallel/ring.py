"""Ring attention: causal attention over a sequence split across the cp ranks, K/V blocks
passed round the ring.

    O_q = sum_b exp(lse_qb - lse_q) O_qb,   lse_q = log sum_b exp(lse_qb)

where O_qb = softmax(q k_b^T s) v_b and lse_qb its row log-sum-exp for the K/V block b of
each rank: a rank computes its queries against its own block, then against each block the
ring brings (rank r receives from r-1 and sends to r+1), merging the partial outputs by
their log-sum-exp. Queries and keys are each two chunks of the load-balanced split
(layout.py), so a chunk pair is skipped where the keys are wholly in the future of the
queries, masked causally on the diagonal, and whole before it. A sliding window (a layer's
own: transformers passes it per call) skips the pairs wholly behind it too and masks the
band where it cuts a pair; soft-capped scores (Gemma-2) are capped before the softmax
(tiles.py). `local_attention` runs the same kernel over one process's whole sequence (the
all-to-all's, under a window or a cap).

Backward: with the final O and lse saved, each block's softmax is recomputed exactly
(p = exp(q k^T s - lse)); dQ stays with the rank, while dK/dV accumulate in a buffer that
travels round the ring one step behind its K/V block and arrives home after cp steps.

Each step's exchange is posted before that step's block is computed, so communication
overlaps computation. K/V travel in the compute precision (bf16 under precision="bf16"); the
blocks, the merge and the travelling dK/dV sums are fp32, as a fused attention kernel's.
Grouped-query attention sends only the K/V heads; each is expanded to its query heads
locally, and their gradients summed back.

Bytes sent per rank per layer, B(lock) = batch x kv heads x 2c tokens x head_dim x element:
forward 2 (cp-1) B (K and V), backward 2 (cp-1) B (K and V again) + 2 cp B (dK, dV). A
window saves compute, not bytes: every block still goes the whole way round (under the
load-balanced split a rank's late chunk needs its neighbour's keys, at the ring's last step).
"""
from __future__ import annotations

import torch

from meshtrain.core.comm import P2P, Comm
from meshtrain.strategies.context_parallel.layout import ChunkLayout
from meshtrain.strategies.context_parallel.tiles import Scoring, expand, fold, scores, tiles

AXIS = "cp"


ROWS = 256
"""Queries per score block: a chunk pair's scores are computed ROWS x c at a time, so a rank
holds a few such blocks at once, not c x c (64 MiB per head group at c = 2048)."""


def ring_attention(q, k, v, comm: Comm, layout: ChunkLayout, scale: float, rows: int = ROWS,
                   window: int | None = None, softcap: float | None = None):
    """Causal attention of this rank's queries over the whole sequence's keys.
    q (B, H, 2c, D), k and v (B, Hkv, 2c, D), H a multiple of Hkv -> (B, H, 2c, D);
    `window`: keys a query sees (sliding-window attention), `softcap`: scores capped
    (tiles.py)."""
    scoring = Scoring(scale, window, softcap).within(layout.size * q.size(2))
    return _RingAttention.apply(q, k, v, comm, layout, scoring, rows)


def local_attention(q, k, v, scoring: Scoring, rows: int = ROWS):
    """The same kernel over one process's whole sequence (q (B, H, T, D) in sequence
    order): no exchange."""
    return _RingAttention.apply(q, k, v, None, ChunkLayout(0, 1),
                                scoring.within(q.size(2)), rows)


CHANNELS = {"ring-kv": 0, "ring-dkv": 1}
"""c10d tags: in backward a block's K/V and an accumulator of the same shape are in flight
between the same two ranks at once (NCCL ignores tags, but every rank posts them in the
same order)."""


def _exchange(comm: Comm, layout: ChunkLayout, send, receive, tag: str) -> list:
    """Post: `send` to the next rank of the ring, `receive` from the previous one."""
    n, channel = layout.size, CHANNELS[tag]
    return comm.batch_isend_irecv([P2P(send, (layout.rank + 1) % n, send=True, match=channel),
                                   P2P(receive, (layout.rank - 1) % n, send=False,
                                       match=channel)], AXIS, tag=tag)


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm | None, layout: ChunkLayout, scoring: Scoring,
                rows: int):
        qs = q.float().chunk(2, dim=2)                      # 2 x (B, H, c, D)
        c = qs[0].size(2)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)   # (B, H, 2c)
        outs, lses = out.chunk(2, dim=2), lse.chunk(2, dim=2)
        kv = torch.stack([k, v])                            # (2, B, Hkv, 2c, D)
        for step in range(layout.size):
            owner = (layout.rank - step) % layout.size
            if step < layout.size - 1:                      # the next block, while computing
                incoming = torch.empty_like(kv)
                handles = _exchange(comm, layout, kv, incoming, "ring-kv")
            ks, vs = kv[0].float().chunk(2, dim=2), kv[1].float().chunk(2, dim=2)
            for t in tiles(layout, owner, c, rows, scoring.window):
                s = scores(qs[t.a][:, :, t.rows], ks[t.b][:, :, t.cols], scoring, t)
                block_lse = s.logsumexp(-1)                 # (B, H, rows): finite (tiles.py)
                block = s.sub_(block_lse.unsqueeze(-1)).exp_() @ expand(
                    vs[t.b][:, :, t.cols], q.size(1))
                _merge(outs[t.a][:, :, t.rows], lses[t.a][:, :, t.rows], block, block_lse)
            if step < layout.size - 1:
                _wait(handles)
                kv = incoming
        # laid out (B, 2c, H, D), as SDPA lays its output: merging the heads is then a view,
        # and the block's activations are one process's / cp
        out = out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.scoring, ctx.rows = comm, layout, scoring, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, n = ctx.comm, ctx.layout, ctx.layout.size
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)            # (B, H, 2c): rowsum(dO o O)
        saved = (q.float().chunk(2, dim=2), grad_out.chunk(2, dim=2), lse.chunk(2, dim=2),
                 delta.chunk(2, dim=2))
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        travelling = None   # (handles, buffer): the dK/dV accumulator arriving with kv
        for step in range(n):
            owner = (layout.rank - step) % n
            if step < n - 1:
                incoming = torch.empty_like(kv)
                handles = _exchange(comm, layout, kv, incoming, "ring-kv")
            part = _block_grads(kv, saved, dq.chunk(2, dim=2), layout, owner, ctx.scoring,
                                ctx.rows)
            if travelling is not None:                      # the block's earlier shares
                _wait(travelling[0])
                part += travelling[1]
            if n == 1:                                      # one process: home already
                travelling = ([], part)
                break
            arriving = torch.empty_like(part)
            travelling = (_exchange(comm, layout, part, arriving, "ring-dkv"), arriving)
            if step < n - 1:
                _wait(handles)
                kv = incoming
        _wait(travelling[0])   # after n steps each accumulator is back with its owner
        dkv = travelling[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _block_grads(kv, saved, dqs, layout: ChunkLayout, owner: int, scoring: Scoring,
                 rows: int):
    """This rank's share of dK, dV of `owner`'s block (2, B, Hkv, 2c, D), fp32; its
    queries' dQ added into `dqs` in place. Each tile's softmax is recomputed exactly from
    the saved log-sum-exp: p = exp(s - lse), dS = p (dP - delta), through the cap's slope."""
    qs, dos, lses, deltas = saved
    heads, c, kv_heads = qs[0].size(1), qs[0].size(2), kv.size(2)
    part = torch.zeros_like(kv, dtype=torch.float32)
    ks, vs = kv[0].float().chunk(2, dim=2), kv[1].float().chunk(2, dim=2)
    dks, dvs = part[0].chunk(2, dim=2), part[1].chunk(2, dim=2)
    for t in tiles(layout, owner, c, rows, scoring.window):
        q_r, do_r = qs[t.a][:, :, t.rows], dos[t.a][:, :, t.rows]
        k_b, v_b = ks[t.b][:, :, t.cols], vs[t.b][:, :, t.cols]
        p, slope = scores(q_r, k_b, scoring, t, slope=True)
        p.sub_(lses[t.a][:, :, t.rows].unsqueeze(-1)).exp_()
        dvs[t.b][:, :, t.cols].add_(fold(p.transpose(-2, -1) @ do_r, kv_heads))
        dp = do_r @ expand(v_b, heads).transpose(-2, -1)
        ds = dp.sub_(deltas[t.a][:, :, t.rows].unsqueeze(-1)).mul_(p)   # 2 blocks
        if slope is not None:
            ds.mul_(slope)
        ds.mul_(scoring.scale)
        dqs[t.a][:, :, t.rows].add_(ds @ expand(k_b, heads))
        dks[t.b][:, :, t.cols].add_(fold(ds.transpose(-2, -1) @ q_r, kv_heads))
    return part


def _merge(out, lse, block_out, block_lse) -> None:
    """A block's partial attention merged into the running one of the same queries, in
    place, by their log-sum-exp (the running lse starts at -inf, its output at 0)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
