"""Flat, padded shards: how ZeRO lays parameters out so that each rank owns exactly 1/N.

The parameters are grouped into the same buckets as their gradients (buckets.py), each
bucket padded to a multiple of N. A bucket's parameters become views into one flat `data`
buffer of that length, and rank r owns the element range [r*k, (r+1)*k) of every bucket,
k = length / N:

    bucket:  | p0 ...... | p1 .. | p2 ........ |pad|       length = N * k
    ranks:   |  rank 0  |  rank 1  |  rank 2  |  ...      each exactly k elements

So a rank's shard is exactly 1/N of the padded total, cutting through parameters where it
must (ZeroRedundancyOptimizer shards whole parameters instead: measured 3.34M / 3.30M AdamW
elements at world 2). Every per-element tensor the optimizer holds (moments, master weights)
has the shard's layout; `FlatLayout` converts such shards to per-parameter tensors and back.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.strategies.shared.buckets import Bucket


@dataclass(frozen=True)
class Piece:
    """Where parameter `name` lies in bucket `bucket`: elements [start, start + numel)."""
    name: str
    bucket: int
    start: int
    numel: int
    shape: tuple[int, ...]


class FlatLayout:
    """The buckets' layout: every parameter's place, and this rank's range in each bucket."""

    def __init__(self, buckets: list[Bucket], names: dict[int, str], n: int, rank: int,
                 splits: dict[int, tuple[int, int]] | None = None) -> None:
        """Each bucket split over `n` ranks, this one `rank`; `splits`: bucket index ->
        (n, rank) for a bucket split over another group (experts over their edp group)."""
        self.n, self.rank = n, rank
        self.splits = splits or {}
        self.lengths = [b.numel for b in buckets]
        self.pieces = [Piece(names[id(p)], b.index, o, p.numel(), tuple(p.shape))
                       for b in buckets for o, p in zip(b.offsets, b.params)]
        self.by_name = {piece.name: piece for piece in self.pieces}

    def split_of(self, bucket: int) -> tuple[int, int]:
        """(ranks, this rank's index) that bucket `bucket` is split over."""
        return self.splits.get(bucket, (self.n, self.rank))

    def shard_size(self, bucket: int) -> int:
        return self.lengths[bucket] // self.split_of(bucket)[0]

    def owned(self, piece: Piece) -> tuple[int, int]:
        """The part of `piece` in this rank's shard: (start, stop) within the shard."""
        k, rank = self.shard_size(piece.bucket), self.split_of(piece.bucket)[1]
        lo = max(piece.start, rank * k)
        hi = min(piece.start + piece.numel, (rank + 1) * k)
        if hi <= lo:
            return 0, 0
        return lo - rank * k, hi - rank * k

    def owned_range(self, name: str) -> tuple[int, int]:
        """The part of parameter `name` in this rank's shard, as a range of its elements."""
        piece = self.by_name[name]
        lo, hi = self.owned(piece)
        base = self.shard_size(piece.bucket) * self.split_of(piece.bucket)[1] - piece.start
        return (lo + base, hi + base) if hi > lo else (0, 0)

    def shards_of(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
        """This rank's shard of each bucket from each parameter's tensor, whole or only its
        `owned_range` (flattened); padding and absent parameters zero."""
        shards = [torch.zeros(self.shard_size(i), dtype=dtype, device=device)
                  for i in range(len(self.lengths))]
        for piece in self.pieces:
            lo, hi = self.owned(piece)
            if hi <= lo or piece.name not in tensors:
                continue
            value = tensors[piece.name].reshape(-1)
            if value.numel() == piece.numel:   # whole: cut out this rank's range
                value = value[slice(*self.owned_range(piece.name))]
            shards[piece.bucket][lo:hi] = value
        return shards

    def shard_view(self, shards: list[torch.Tensor], name: str) -> torch.Tensor:
        """This rank's part of parameter `name` in per-bucket shard tensors (maybe empty)."""
        piece = self.by_name[name]
        lo, hi = self.owned(piece)
        return shards[piece.bucket][lo:hi]

    # ---- whole buckets <-> per-parameter tensors ----------------------------------------------
    def split(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole (unsharded) bucket tensors -> each parameter's tensor, by name (views)."""
        return {p.name: flats[p.bucket][p.start:p.start + p.numel].view(p.shape)
                for p in self.pieces}

    def join(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
        """Each parameter's tensor -> whole bucket tensors (padding zero)."""
        flats = [torch.zeros(length, dtype=dtype, device=device) for length in self.lengths]
        for p in self.pieces:
            flats[p.bucket][p.start:p.start + p.numel] = tensors[p.name].reshape(-1)
        return flats

    def my_shards(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shard of each whole bucket tensor (views)."""
        return [flat.view(self.split_of(i)[0], -1)[self.split_of(i)[1]]
                for i, flat in enumerate(flats)]

    def gather(self, shards: list[torch.Tensor], comm: Comm, axis: str,
               tag: str = "state") -> list[torch.Tensor]:
        """Whole bucket tensors from every rank's shard (an all-gather over `axis` each).
        Offloaded shards cross the group on the mesh's device (NCCL takes no host tensor)
        and land where they were kept."""
        flats, device = [], comm.mesh.device
        for shard in shards:
            flat = torch.empty(shard.numel() * comm.mesh.size(axis), dtype=shard.dtype,
                               device=device)
            comm.all_gather(flat, shard.to(device).contiguous(), axis, tag=tag)
            flats.append(flat.to(shard.device))
        return flats

    def regather(self, bucket: int, shard: torch.Tensor, wanted: list[list[tuple[int, int]]],
                 comm: Comm, axis: str, tag: str = "state") -> torch.Tensor:
        """Of bucket `bucket`, the element ranges this rank wants, from every rank's `shard`
        of it: one all-to-all, each rank sending each other the part of its ranges its own
        shard holds (never the whole bucket). `wanted[q]`: rank q's ranges, disjoint and in
        order. Returns this rank's ranges, concatenated in order, on the mesh's device."""
        n, rank = self.split_of(bucket)
        k, device = self.shard_size(bucket), comm.mesh.device
        mine = shard.to(device)   # offloaded shards cross on the compute device

        def overlaps(ranges, r):   # the parts of `ranges` in rank r's shard, within it
            return [(max(lo, r * k) - r * k, min(hi, (r + 1) * k) - r * k)
                    for lo, hi in ranges if min(hi, (r + 1) * k) > max(lo, r * k)]
        sends = [overlaps(wanted[q], rank) for q in range(n)]
        parts = [mine[lo:hi] for ranges in sends for lo, hi in ranges]
        sent = torch.cat(parts) if parts else mine[:0]
        received = [sum(hi - lo for lo, hi in overlaps(wanted[rank], r)) for r in range(n)]
        out = torch.empty(sum(received), dtype=shard.dtype, device=device)
        comm.all_to_all(out, sent, axis, tag=tag, output_splits=received,
                        input_splits=[sum(hi - lo for lo, hi in ranges) for ranges in sends])
        return out


def flatten_into_buckets(buckets: list[Bucket], dtype: torch.dtype) -> list[torch.Tensor]:
    """Make each bucket's parameters views into one flat `dtype` buffer of the bucket's
    (padded) length, holding their current values; returns the buffers."""
    buffers = []
    for b in buckets:
        flat = torch.zeros(b.numel, dtype=dtype, device=b.device)
        for o, p in zip(b.offsets, b.params):
            view = flat[o:o + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        buffers.append(flat)
    return buffers


def parameter_groups(params: list[nn.Parameter], shared: list[nn.Parameter],
                     chunks: list[nn.Module] = ()) -> list[list[nn.Parameter]]:
    """Bucket groups: every parameter in backward order, cut where one of `chunks` (an
    interleaved stage's chunks, when given) ends and the next begins, then the shared ones in
    a bucket of their own, laid out the same on every stage holding them (last: on the first
    stage the tied embedding's gradient is the last one backward produces)."""
    taken = {id(p) for p in shared}
    chunk_of = {id(p): i for i, c in enumerate(chunks) for p in c.parameters()}
    groups: list[list[nn.Parameter]] = []
    for p in reversed(params):
        if id(p) in taken:
            continue
        if groups and chunk_of.get(id(groups[-1][-1])) == chunk_of.get(id(p)):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups + [list(shared)]


@contextmanager
def keep_unstepped(layout: FlatLayout, names: list[str], shards: list[torch.Tensor],
                   optimizer: torch.optim.Optimizer):
    """Put back, after the block (an optimizer step), this rank's elements of the parameters
    `names` in the flat shards the optimizer steps (one per bucket) and in its per-element
    states of them: a flat shard is stepped whole, but one process's optimizer skips a
    parameter nobody used (its .grad is None)."""
    kept = []
    for name in names:
        piece = layout.by_name[name]
        shard = shards[piece.bucket]
        lo, hi = layout.owned(piece)
        tensors = [shard] + [t for t in optimizer.state.get(shard, {}).values()
                             if isinstance(t, torch.Tensor) and t.shape == shard.shape]
        kept += [(t, lo, hi, t.detach()[lo:hi].clone()) for t in tensors]
    yield
    with torch.no_grad():
        for t, lo, hi, value in kept:
            t[lo:hi] = value
