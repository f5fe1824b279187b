"""Which score blocks of a chunk pair attention computes, and their scores: causal, with an
optional sliding window and logit soft-capping (the ring's kernel, and the all-to-all's
when a window or a cap rules out SDPA).

A query at place p sees the keys at places p - window < j <= p (transformers' sliding
window: `window` keys, its own included; window None: every earlier key). For the query
chunk gq and key chunk gk of c tokens, row i and column j are at distance
gap + i - j, gap = (gq - gk) c. A pair whose every distance is negative (the keys in the
future) or at least the window (the keys behind the window) is no tile at all; the rows
of a pair reaching no key are left out, and each row block reads only the columns in its
reach, so every row of a tile sees at least one key (its log-sum-exp is finite) and a
window w computes about w keys a query, not the whole sequence.

Soft-capping (Gemma-2): scores s = cap tanh(s0 / cap), s0 = q k^T scale, before the mask
and the softmax; the backward multiplies by ds/ds0 = 1 - tanh^2 = 1 - (s / cap)^2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from meshtrain.strategies.context_parallel.layout import ChunkLayout


@dataclass(frozen=True)
class Scoring:
    """How a block's scores are made: q k^T `scale`, capped at `softcap` (None: not), and
    masked to `window` keys a query (None: causal only)."""
    scale: float
    window: int | None = None
    softcap: float | None = None

    def within(self, length: int) -> Scoring:
        """The same for a sequence of `length` tokens: a window that covers it is none."""
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window of {self.window} keys sees no key; "
                             "use a window of at least 1, or None")
        if self.window is not None and self.window >= length:
            return Scoring(self.scale, None, self.softcap)
        return self


class Tile(NamedTuple):
    """A block of a chunk pair: local chunk indices of the queries (a) and keys (b), the
    query rows and key columns it covers, the distance of its first row from its first
    column, and whether any of its scores is masked."""
    a: int
    b: int
    rows: slice
    cols: slice
    offset: int
    masked: bool


def tiles(layout: ChunkLayout, owner: int, c: int, rows: int, window: int | None):
    """The tiles of this rank's queries against `owner`'s K/V block (chunks of c tokens),
    `rows` query rows at a time; none for a pair wholly in the future or behind the window."""
    for a, gq in enumerate(layout.chunks):
        for b, gk in enumerate(layout.chunk_of(owner)):
            gap = (gq - gk) * c
            if gap < 0:
                continue                                    # keys in the future
            reach = c if window is None else min(c, c - 1 + window - gap)   # rows seeing a key
            for start in range(0, max(reach, 0), rows):
                stop = min(start + rows, reach)
                first = 0 if window is None else max(0, gap + start - window + 1)
                last = min(c, gap + stop)                   # keys up to the last row's place
                offset = gap + start - first
                masked = offset - (last - first - 1) < 0 or (
                    window is not None and offset + stop - start - 1 >= window)
                yield Tile(a, b, slice(start, stop), slice(first, last), offset, masked)


def pairs(layout: ChunkLayout, owner: int, c: int, window: int | None) -> int:
    """How many of the 4 chunk pairs against `owner`'s block have any score to compute."""
    return len({(t.a, t.b) for t in tiles(layout, owner, c, c, window)})


def scores(q, k, scoring: Scoring, tile: Tile, slope: bool = False):
    """A tile's scores (B, H, rows, cols), the keys expanded to the query heads (GQA),
    capped and masked; with `slope`, also ds/ds0 of the cap (None without one)."""
    s = (q @ expand(k, q.size(1)).transpose(-2, -1)).mul_(scoring.scale)
    derivative = None
    if scoring.softcap is not None:
        s.div_(scoring.softcap).tanh_()
        derivative = 1 - s.square() if slope else None
        s.mul_(scoring.softcap)
    if tile.masked:
        s.masked_fill_(~_band(s.shape[-2:], tile.offset, scoring.window, s.device),
                       float("-inf"))
    return (s, derivative) if slope else s


def _band(shape, offset: int, window: int | None, device) -> torch.Tensor:
    """(rows, cols) bool: row i sees column j where 0 <= offset + i - j < window."""
    distance = (offset + torch.arange(shape[0], device=device)[:, None]
                - torch.arange(shape[1], device=device)[None, :])
    seen = distance >= 0
    return seen if window is None else seen & (distance < window)


def expand(kv, heads: int):
    """(B, Hkv, c, D) -> (B, H, c, D): each K/V head serves H / Hkv query heads in a row."""
    return kv if kv.size(1) == heads else kv.repeat_interleave(heads // kv.size(1), dim=1)


def fold(grad, kv_heads: int):
    """The reverse of `expand` for gradients: sum each group's query heads."""
    B, H, c, D = grad.shape
    return grad if H == kv_heads else grad.view(B, kv_heads, H // kv_heads, c, D).sum(2)
