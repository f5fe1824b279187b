"""PowerSGD's rule for which gradient matrices it compresses, and at what rank: shared by the
runtime (strategies/data_parallel/powersgd.py) and the planner (planner/compression.py),
which must price exactly what the runtime sends (and imports no torch)."""


def factor_rank(rows: int, cols: int, rank: int, min_rate: float) -> int:
    """The rank r = min(rank, rows, cols) at which a rows x cols matrix travels as factors,
    or 0 where its compression rate rows cols / ((rows + cols) r) does not exceed `min_rate`
    (it then travels whole)."""
    r = min(rank, rows, cols)
    return r if rows * cols > min_rate * (rows + cols) * r else 0
