"""Context parallel's tiles (strategies/context_parallel/tiles.py): over every rank and ring
step, each (query, key) pair a sliding window lets a query see is computed once, none
outside it unmasked, and what a window skips is counted against the causal work."""
import itertools

import pytest

from meshtrain.strategies.context_parallel.layout import ChunkLayout
from meshtrain.strategies.context_parallel.tiles import Scoring, pairs, tiles


def computed(cp: int, c: int, rows: int, window):
    """Every score the ring computes at cp over chunks of c tokens, as (query place, key
    place, masked) over all ranks and steps."""
    out = []
    for rank, owner in itertools.product(range(cp), range(cp)):
        layout = ChunkLayout(rank, cp)
        for t in tiles(layout, owner, c, rows, window):
            gq, gk = layout.chunks[t.a], layout.chunk_of(owner)[t.b]
            for i, j in itertools.product(range(t.rows.start, t.rows.stop),
                                          range(t.cols.start, t.cols.stop)):
                assert i - t.rows.start - (j - t.cols.start) + t.offset == \
                    (gq * c + i) - (gk * c + j)          # the tile's offset is the distance
                out.append((gq * c + i, gk * c + j, t.masked))
    return out


@pytest.mark.parametrize("cp, c, rows, window", [(2, 4, 3, 6), (2, 4, 4, None), (4, 4, 3, 5),
                                                 (4, 8, 3, 1), (2, 8, 5, 13)])
def test_each_score_in_the_window_is_computed_once_and_every_row_sees_a_key(cp, c, rows,
                                                                            window):
    T = 2 * cp * c
    seen = {(p, j) for p in range(T) for j in range(T) if 0 <= p - j < (window or T)}
    scores = computed(cp, c, rows, window)
    inside = [(p, j) for p, j, _ in scores if (p, j) in seen]
    assert sorted(inside) == sorted(seen)                  # each once
    assert all(masked for p, j, masked in scores if (p, j) not in seen)
    rows_with_a_key = {p for p, j in inside}
    assert {p for p, _, _ in scores} == rows_with_a_key    # no tile row reaching no key


def test_a_window_skips_pairs_and_scores():
    # cp 2, chunks of 4 (16 tokens), a window of 6: rank 0 holds chunks 0 and 3; against its
    # own block chunk 3 is 9 or more behind chunk 0's keys, so only the two diagonals remain
    assert pairs(ChunkLayout(0, 2), 0, 4, None) == 3 and pairs(ChunkLayout(0, 2), 0, 4, 6) == 2
    # against rank 1's chunks 1 and 2: chunk 3 reaches both (one row of chunk 1's keys)
    assert pairs(ChunkLayout(0, 2), 1, 4, 6) == 2
    # scores computed over every rank and step, rows of 4 (a whole chunk) at a time:
    # causal, the 4 diagonal blocks (16 each, masked) and the 6 pairs before them (16 each)
    assert len(computed(2, 4, 4, None)) == 4 * 16 + 6 * 16
    # a window of 6: the diagonals and the 3 pairs one chunk apart whole; of the 2 pairs two
    # chunks apart only the first query row reaches a key (the last column); the pair three
    # chunks apart not at all
    assert len(computed(2, 4, 4, 6)) == 4 * 16 + 3 * 16 + 2 * 1


def test_a_window_covering_the_sequence_is_none_and_an_empty_one_is_refused():
    assert Scoring(0.5, 16, 5.0).within(16) == Scoring(0.5, None, 5.0)
    assert Scoring(0.5, 15).within(16).window == 15
    with pytest.raises(ValueError, match="a sliding window of 0 keys sees no key"):
        Scoring(0.5, 0).within(16)
