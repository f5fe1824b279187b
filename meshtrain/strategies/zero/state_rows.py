"""A checkpoint's rows of each parameter straight from ZeRO's flat shards (`ZeRO.state_rows`).

A checkpoint writes each parameter and its optimizer states as every rank's range of rows
(train/checkpoint_shares.py, [Note: even shares]). Under ZeRO those rows are a few element
ranges of each bucket, spread over the ranks' shards: one all-to-all per bucket tensor
(`FlatLayout.regather`) brings each rank its ranges, so no rank holds a whole bucket (nor
gloo's copy of one) to save; parameters whole on every rank (ZeRO-1/2 in the model's
dtype) are cut where they are. An expert bucket under expert parallel is sharded over its
edp group: `rows_of` answers its edp ranks' rows, and the all-to-all runs over that group.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from meshtrain.core.regions import narrow_rows
from meshtrain.strategies.shared.flat import Piece

# (name, shape, bytes per element with its states) -> every rank's (first, last) row
RowsOf = Callable[[str, tuple[int, ...], int], list[tuple[int, int]]]


def state_rows(zero, rows_of: RowsOf) -> Iterator[tuple[dict, dict]]:
    """(parameters, optimizer states) by name, each this rank's rows of it: of each bucket
    the parameters (with their 0-dim states), then each per-element state apart;
    collective over the ZeRO axis."""
    layout = zero.layout
    for i in range(len(zero.buckets)):
        pieces = [p for p in layout.pieces if p.bucket == i]
        master = zero.masters.masters[i]
        state = zero.optimizer.state.get(master, {})
        per_element = {k: v for k, v in state.items()
                       if isinstance(v, torch.Tensor) and v.shape == master.shape}
        state_bytes = sum(v.element_size() for v in per_element.values())
        rows = {p.name: rows_of(p.name, p.shape, master.element_size() + (
                    state_bytes if p.name in zero._stepped else 0)) for p in pieces}
        wanted = [[_elements(p, rows[p.name][q]) for p in pieces if _some(rows[p.name][q])]
                  for q in range(layout.split_of(i)[0])]
        me = layout.split_of(i)[1]
        comm, axis = zero._where(i)
        if zero.stage < 3 and not zero.masters.mixed:   # whole on every rank already
            params = {p.name: narrow_rows(zero.named[p.name].detach(), rows[p.name][me])
                      for p in pieces if _some(rows[p.name][me])}
        else:
            params = _split(pieces, rows, me, layout.regather(i, master.detach(), wanted, comm,
                                                              axis, tag="param"))
        stepped = [name for name in params if name in zero._stepped]
        scalars = {k: v for k, v in state.items() if k not in per_element}   # Adam's step
        yield params, {name: {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in scalars.items()} for name in stepped}
        del params
        for key, value in per_element.items():   # one state at a time: less in transit
            parts = _split(pieces, rows, me, layout.regather(i, value, wanted, comm, axis))
            yield {}, {name: {key: parts[name]} for name in stepped}
            del parts


def _some(rows: tuple[int, int]) -> bool:
    return rows[1] > rows[0]


def _row_numel(piece: Piece) -> int:
    return piece.numel // piece.shape[0] if piece.shape else 1


def _elements(piece: Piece, rows: tuple[int, int]) -> tuple[int, int]:
    """Rows (first, last) of `piece` as a range of its bucket's elements."""
    row = _row_numel(piece)
    return piece.start + rows[0] * row, piece.start + rows[1] * row


def _split(pieces: list[Piece], rows: dict, me: int, flat: torch.Tensor) -> dict:
    """This rank's rows of each piece, from `flat`: its ranges concatenated in order."""
    out, at = {}, 0
    for p in pieces:
        first, last = rows[p.name][me]
        if last > first:
            shape = (last - first, *p.shape[1:]) if p.shape else ()
            size = (last - first) * _row_numel(p)
            out[p.name] = flat[at:at + size].view(shape)
            at += size
    return out
