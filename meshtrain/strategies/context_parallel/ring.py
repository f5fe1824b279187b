"""Ring attention: causal attention over a sequence split across the cp ranks, K/V blocks
passed round the ring.

    O_q = sum_b exp(lse_qb - lse_q) O_qb,   lse_q = log sum_b exp(lse_qb)

where O_qb = softmax(q k_b^T s) v_b and lse_qb its row log-sum-exp for the K/V block b of
each rank: a rank computes its queries against its own block, then against each block the
ring brings (rank r receives from r-1 and sends to r+1), merging the partial outputs by
their log-sum-exp. Queries and keys are each two chunks of the load-balanced split
(layout.py), so a chunk pair is skipped where the keys are wholly in the future of the
queries, masked causally on the diagonal, and whole before it.

Backward: with the final O and lse saved, each block's softmax is recomputed exactly
(p = exp(q k^T s - lse)); dQ stays with the rank, while dK/dV accumulate in a buffer that
travels round the ring one step behind its K/V block and arrives home after cp steps.

Each step's exchange is posted before that step's block is computed, so communication
overlaps computation. K/V travel in the compute precision (bf16 under precision="bf16"); the
blocks, the merge and the travelling dK/dV sums are fp32, as a fused attention kernel's.
Grouped-query attention sends only the K/V heads; each is expanded to its query heads
locally, and their gradients summed back.

Bytes sent per rank per layer, B(lock) = batch x kv heads x 2c tokens x head_dim x element:
forward 2 (cp-1) B (K and V), backward 2 (cp-1) B (K and V again) + 2 cp B (dK, dV).
"""
from __future__ import annotations

import torch

from meshtrain.core.comm import P2P, Comm
from meshtrain.strategies.context_parallel.layout import ChunkLayout

AXIS = "cp"


ROWS = 256
"""Queries per score block: a chunk pair's scores are computed ROWS x c at a time, so a rank
holds a few such blocks at once, not c x c (64 MiB per head group at c = 2048)."""


def ring_attention(q, k, v, comm: Comm, layout: ChunkLayout, scale: float, rows: int = ROWS):
    """Causal attention of this rank's queries over the whole sequence's keys.
    q (B, H, 2c, D), k and v (B, Hkv, 2c, D), H a multiple of Hkv -> (B, H, 2c, D)."""
    return _RingAttention.apply(q, k, v, comm, layout, scale, rows)


def _tiles(layout: ChunkLayout, owner: int, c: int, rows: int):
    """(query chunk, key chunk, query rows, causal) for each block of a chunk pair with any
    key not in the future: local chunk indices (0 or 1) of this rank's queries and of
    `owner`'s keys, and a slice of the query chunk's rows; causal: the pair is the diagonal."""
    for a, gq in enumerate(layout.chunks):
        for b, gk in enumerate(layout.chunk_of(owner)):
            if gk <= gq:
                for start in range(0, c, rows):
                    yield a, b, slice(start, min(start + rows, c)), gk == gq


def _scores(q, k, scale: float, causal: bool, first_row: int):
    """q k^T s, (B, H, rows, c), with the keys expanded to the query heads (GQA); causal:
    query row i (row first_row + i of its chunk) sees keys 0 .. first_row + i."""
    s = (q @ _expand(k, q.size(1)).transpose(-2, -1)).mul_(scale)
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
        s.masked_fill_(future.triu(first_row + 1), float("-inf"))
    return s


def _expand(kv, heads: int):
    """(B, Hkv, c, D) -> (B, H, c, D): each K/V head serves H / Hkv query heads in a row."""
    return kv if kv.size(1) == heads else kv.repeat_interleave(heads // kv.size(1), dim=1)


def _fold(grad, kv_heads: int):
    """The reverse of `_expand` for gradients: sum each group's query heads."""
    B, H, c, D = grad.shape
    return grad if H == kv_heads else grad.view(B, kv_heads, H // kv_heads, c, D).sum(2)


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
    def forward(ctx, q, k, v, comm: Comm, layout: ChunkLayout, scale: float, rows: int):
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
            for a, b, r, causal in _tiles(layout, owner, c, rows):
                s = _scores(qs[a][:, :, r], ks[b], scale, causal, r.start)   # then in place
                block_lse = s.logsumexp(-1)                 # (B, H, rows)
                block = s.sub_(block_lse.unsqueeze(-1)).exp_() @ _expand(vs[b], q.size(1))
                _merge(outs[a][:, :, r], lses[a][:, :, r], block, block_lse)
            if step < layout.size - 1:
                _wait(handles)
                kv = incoming
        # laid out (B, 2c, H, D), as SDPA lays its output: merging the heads is then a view,
        # and the block's activations are one process's / cp
        out = out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.scale, ctx.rows = comm, layout, scale, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, scale, rows = ctx.comm, ctx.layout, ctx.scale, ctx.rows
        n, heads, c = layout.size, q.size(1), q.size(2) // 2
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)            # (B, H, 2c): rowsum(dO o O)
        qs, dos = q.float().chunk(2, dim=2), grad_out.chunk(2, dim=2)
        lses, deltas = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dqs = dq.chunk(2, dim=2)
        kv = torch.stack([k, v])
        travelling = None   # (handles, buffer): the dK/dV accumulator arriving with kv
        for step in range(n):
            owner = (layout.rank - step) % n
            if step < n - 1:
                incoming = torch.empty_like(kv)
                handles = _exchange(comm, layout, kv, incoming, "ring-kv")
            part = torch.zeros_like(kv, dtype=torch.float32)   # this rank's share of dK, dV
            ks, vs = kv[0].float().chunk(2, dim=2), kv[1].float().chunk(2, dim=2)
            dks, dvs = part[0].chunk(2, dim=2), part[1].chunk(2, dim=2)
            for a, b, r, causal in _tiles(layout, owner, c, rows):
                q_r, do_r = qs[a][:, :, r], dos[a][:, :, r]
                p = _scores(q_r, ks[b], scale, causal, r.start)
                p.sub_(lses[a][:, :, r].unsqueeze(-1)).exp_()
                dvs[b].add_(_fold(p.transpose(-2, -1) @ do_r, kv.size(2)))
                dp = do_r @ _expand(vs[b], heads).transpose(-2, -1)
                ds = dp.sub_(deltas[a][:, :, r].unsqueeze(-1)).mul_(p).mul_(scale)   # 2 blocks
                dqs[a][:, :, r].add_(ds @ _expand(ks[b], heads))
                dks[b].add_(_fold(ds.transpose(-2, -1) @ q_r, kv.size(2)))
            if travelling is not None:                      # the block's earlier shares
                _wait(travelling[0])
                part += travelling[1]
            arriving = torch.empty_like(part)
            travelling = (_exchange(comm, layout, part, arriving, "ring-dkv"), arriving)
            if step < n - 1:
                _wait(handles)
                kv = incoming
        _wait(travelling[0])   # after n steps each accumulator is back with its owner
        dkv = travelling[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _merge(out, lse, block_out, block_lse) -> None:
    """A block's partial attention merged into the running one of the same queries, in
    place, by their log-sum-exp (the running lse starts at -inf, its output at 0)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
