"""Cutting a list of layer weights into consecutive pipeline stages: the one partition the
pipeline (strategies/pipeline/partition.py, weights read from the layers' modules) and the
planner (planner/stage_split.py, the same weights from a model spec) both make, so the
planner prices the stages the runtime builds.

A layer's compute weight is its training FLOPs per token (forward and backward): 6 per
parameter a matmul multiplies by (an embedding's lookup: 0, its backward is a scatter-add),
12 x seq x width per attention (scores and weighted sum), and on the head the loss's
LOSS_FLOPS_PER_LOGIT per logit. Megatron places the embedding and the loss by hand
(account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split); weighing
every layer by its FLOPs places them without a rule of thumb.
"""
from __future__ import annotations

# log-softmax forward (max, subtract, exp, sum, log, subtract) and its backward (softmax
# minus the one-hot, scaled): a few FLOPs per logit, small beside the head's 6 x width
LOSS_FLOPS_PER_LOGIT = 8


def block_flops(matmul_params: float, attentions: int, seq: int, width: int) -> float:
    """Training FLOPs per token of a layer multiplying by `matmul_params` weights and
    running `attentions` attentions of `width` query channels over `seq` keys."""
    return 6 * matmul_params + 12 * seq * width * attentions


def balanced_cuts(weights: list[float], stages: int) -> list[int]:
    """Boundaries [0, c1, ..., len(weights)] of `stages` consecutive non-empty groups whose
    heaviest group is as light as possible (linear partition, by dynamic programming)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest group splitting the first i layers into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def blocks_per_rank(bounds: list[int], pp: int) -> list[int]:
    """Layers between the first and the last (the blocks) each of `pp` ranks runs, where
    stage c of len(bounds) - 1 runs layers[bounds[c]:bounds[c+1]] on rank c % pp."""
    n = bounds[-1]
    out = [0] * pp
    for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out[c % pp] += max(0, min(b, n - 1) - max(a, 1))
    return out
