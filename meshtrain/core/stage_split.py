"""Cutting a list of layer weights into consecutive pipeline stages: the one partition the
pipeline (strategies/pipeline/partition.py, weights read from the layers' modules) and the
planner (planner/stage_split.py, the same weights from a model spec) both make, so the
planner prices the stages the runtime builds.

A layer's compute weight is its training FLOPs per token (forward and backward) in its
matmuls: 6 per weight a token multiplies by (an embedding's lookup: 0, its backward is a
scatter-add), and on the head the loss's LOSS_FLOPS_PER_LOGIT per logit. Attention's
scores (12 x seq x width per block) are left out: they are the same in every block and
depend on the sequence trained, which the cut is made before seeing (a transformers
config's context, 131072 for Llama 3.2, is far from it); at long sequences the head's stage
then gets a block or so fewer than the optimum (Plan.stage_cuts cuts by hand). Megatron
places the embedding and the loss by hand (account_for_embedding_in_pipeline_split /
account_for_loss_in_pipeline_split); weighing every layer by its FLOPs places them without
a rule of thumb.
"""
from __future__ import annotations

# log-softmax forward (max, subtract, exp, sum, log, subtract) and its backward (softmax
# minus the one-hot, scaled): a few FLOPs per logit, small beside the head's 6 x width
LOSS_FLOPS_PER_LOGIT = 8
# forward 2 per weight, backward 4 (the input's gradient and the weight's)
TRAIN_FLOPS_PER_WEIGHT = 6


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
            # the last group is layers[j:i]: best[k-1][j] grows with j and the group's
            # weight shrinks, so the lightest heaviest is where they cross (bisected)
            lo, hi = k - 1, i - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if best[k - 1][mid] >= prefix[i] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            for j in (lo - 1, lo):
                cost = max(best[k - 1][j], prefix[i] - prefix[j]) if j >= k - 1 else inf
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
