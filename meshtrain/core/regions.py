"""Which parts of a whole tensor a rank keeps: what a resumed run reads of a checkpoint.

A rank's tensor (a parameter, or an optimizer state shaped like it) is made of boxes of the
whole one: slot 1 says which (a tp slice is one box, or one per fused part: q, k, v); slot 3
may keep only a flat element range of the result (ZeRO's shard). `Region` holds both, so a
checkpoint reads the boxes (full coordinates) and the region assembles the rank's value:

    whole (full shape)  --boxes-->  the rank's tensor (local shape)  --flat-->  its range

A flat range is read as the rows that cover it, then cut (a row is every dim but the first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Box:
    """The part of the whole tensor at `offsets` of `sizes`, found at `local` in the rank's
    tensor."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Region:
    """The rank's tensor (`shape`) made of `boxes` of the whole one (the rest, a padding,
    is zero); `flat`: only elements [start, stop) of it, flattened (None: all of it)."""
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    flat: tuple[int, int] | None = None

    def within(self, flat: tuple[int, int] | None) -> "Region":
        """This region narrowed to a flat range of the rank's tensor (None: unchanged)."""
        return self if flat is None else replace(self, flat=flat)

    def _rows(self) -> tuple[int, int]:
        """The rows (of the rank's tensor) read: all, or those covering the flat range."""
        if not self.shape:
            return 0, 1
        if self.flat is None:
            return 0, self.shape[0]
        row = math.prod(self.shape[1:])
        start, stop = self.flat
        if stop <= start or row == 0:
            return 0, 0
        return start // row, -(-stop // row)

    def reads(self) -> list[Box]:
        """The boxes of the whole tensor to read (`local` relative to the first row read)."""
        if not self.shape:
            return list(self.boxes)
        lo, hi = self._rows()
        out = []
        for box in self.boxes:
            a, b = max(lo, box.local[0]), min(hi, box.local[0] + box.sizes[0])
            if b > a:
                shift = a - box.local[0]
                out.append(Box((box.offsets[0] + shift, *box.offsets[1:]),
                               (b - a, *box.sizes[1:]), (a - lo, *box.local[1:])))
        return out

    def assemble(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The rank's value from the tensors read for `reads()`, in that order."""
        reads = self.reads()
        if not self.shape:
            return parts[0] if parts else torch.zeros((), dtype=dtype, device="cpu")
        lo, hi = self._rows()
        rows = (hi - lo, *self.shape[1:])
        if len(parts) == 1 and reads[0].sizes == rows:
            out = parts[0]   # one box covers the rows: as read, no copy
        else:
            out = torch.zeros(rows, dtype=dtype, device="cpu")
            for box, part in zip(reads, parts):
                out[tuple(slice(o, o + s) for o, s in zip(box.local, box.sizes))] = part
        if self.flat is None:
            return out
        start = self.flat[0] - lo * math.prod(self.shape[1:])
        return out.reshape(-1)[start:start + self.flat[1] - self.flat[0]]

    def share(self) -> int:
        """Elements of the whole tensor this region keeps (padding and rows around a flat
        range left out)."""
        if self.flat is None:
            return sum(box.numel for box in self.boxes)
        lo, hi = self._rows()
        inside = torch.zeros((hi - lo, *self.shape[1:]), dtype=torch.bool, device="cpu")
        for box in self.reads():
            inside[tuple(slice(o, o + s) for o, s in zip(box.local, box.sizes))] = True
        start = self.flat[0] - lo * math.prod(self.shape[1:])
        return int(inside.reshape(-1)[start:start + self.flat[1] - self.flat[0]].sum())


def whole(shape: tuple[int, ...]) -> Region:
    """The whole tensor, as it is."""
    shape = tuple(shape)
    return Region(shape, (Box((0,) * len(shape), shape, (0,) * len(shape)),))


def slice_along(shape: tuple[int, ...], dim: int, start: int, length: int) -> Region:
    """Elements [start, start + length) along `dim`, every other dim whole."""
    shape = tuple(shape)
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(length if d == dim else s for d, s in enumerate(shape))
    return Region(sizes, (Box(offsets, sizes, (0,) * len(shape)),))


def narrow_rows(t: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Rows [first, last) of `t` (a 0-dim tensor whole)."""
    return t if t.dim() == 0 else t.narrow(0, rows[0], rows[1] - rows[0])
