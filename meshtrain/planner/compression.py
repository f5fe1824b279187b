"""PowerSGD's traffic and memory from the model's layer shapes (Vogels et al. 2019), as
meshtrain's PowerSGD sends and keeps them (strategies/data_parallel/powersgd.py).

Each weight matrix M x N travels as two factors, P (M x r) and Q (N x r), with r = min(rank,
M, N), where its compression rate M N / ((M + N) r) exceeds `min_rate`; every other matrix
and every vector (biases, norms) travels whole. Two all-reduces a step: every P with what
travels whole and the step's statistics, then every Q. Each compressed matrix keeps a
residual (M x N) and its Q (N x r) between steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.core.low_rank import factor_rank
from meshtrain.planner.model_spec import ModelSpec


def matrix_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """The model's weight matrices (rows, cols) from its spec: q, k, v, o and the MLP's per
    block (q, k, v apart: a fused qkv module compresses as one h x (h + 2 kv) matrix),
    the token and position embeddings, and the head if untied."""
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_dim
    block = [(h, h), (h, kv), (h, kv), (h, h)] + [(h, f)] * (3 if spec.mlp == "swiglu" else 2)
    rest = [(spec.vocab, h)] + ([(spec.seq, h)] if spec.learned_pos else [])
    return block * spec.layers + rest + ([] if spec.tied else [(spec.vocab, h)])


@dataclass(frozen=True)
class PowerSGDTraffic:
    """Elements per step PowerSGD sends (its first all-reduce: `whole` and `p`; its second:
    `q`), and what it keeps."""
    whole: float       # uncompressed matrices and every vector (the statistics aside)
    p: float           # the P factors, sum of M r
    q: float           # the Q factors, sum of N r
    kept: float        # residuals and warm-started Qs between steps, sum of M N + N r


def powersgd_traffic(spec: ModelSpec, rank: int, min_rate: float = 2.0) -> PowerSGDTraffic:
    whole, p, q, kept = 0.0, 0.0, 0.0, 0.0
    matrices = matrix_shapes(spec)
    for m, n in matrices:
        r = factor_rank(m, n, rank, min_rate)
        if r:
            p, q, kept = p + m * r, q + n * r, kept + m * n + n * r
        else:
            whole += m * n
    vectors = spec.num_params - sum(m * n for m, n in matrices)
    return PowerSGDTraffic(whole + vectors, p, q, kept)
