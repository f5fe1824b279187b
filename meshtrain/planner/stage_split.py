"""Which blocks each pipeline rank holds, as the pipeline cuts them (strategies/pipeline/
partition.py): the same partition (core/stage_split.balanced_cuts) of the same layer list
[embedding, block x layers, head], weighed from the model spec instead of the modules, so
memory, time and traffic are priced for the stages the runtime builds. Rank 0 holds the
embedding and rank pp - 1 the head (the first and the last chunk under interleaving)."""
from __future__ import annotations

import functools
import math

from meshtrain.core.plan import STAGE_BALANCES, Plan
from meshtrain.core.stage_split import (LOSS_FLOPS_PER_LOGIT, TRAIN_FLOPS_PER_WEIGHT,
                                        balanced_cuts, blocks_per_rank)
from meshtrain.planner.model_spec import ModelSpec


def layer_weights(spec: ModelSpec, balance: str) -> list[float]:
    """Each pipeline layer's weight in the balance: training FLOPs per token in its
    matmuls ("compute": the embedding's lookup 0, a block's (a mixture's active experts),
    the head's (tied or not: it multiplies) and the loss) or parameters."""
    if balance == "parameters":   # a tied matrix is a parameter of both the layers
        head = spec.head_params + (spec.vocab * spec.hidden if spec.tied else 0)
        return [spec.embedding_params, *[spec.layer_params] * spec.layers, head]
    block = TRAIN_FLOPS_PER_WEIGHT * spec.layer_matmul_params
    head = TRAIN_FLOPS_PER_WEIGHT * spec.hidden * spec.vocab + LOSS_FLOPS_PER_LOGIT * spec.vocab
    return [0, *[block] * spec.layers, head]


def stage_blocks(spec: ModelSpec, plan: Plan) -> list[int]:
    """Blocks on each of the plan's pp ranks (virtual stages summed): its stage_cuts, else
    the stages balanced by its stage_balance."""
    return list(_stage_blocks(spec, plan.pp, plan.virtual_stages, plan.stage_cuts,
                              plan.stage_balance))


def stage_balances(spec: ModelSpec, pp: int, virtual: int) -> tuple[str, ...]:
    """The stage balances that cut `spec` apart at pp ranks of `virtual` stages: the
    default (compute) first, the parameter balance only where its blocks per rank differ."""
    default, *others = STAGE_BALANCES
    cut = _stage_blocks(spec, pp, virtual, None, default)
    return (default, *(b for b in others if _stage_blocks(spec, pp, virtual, None, b) != cut))


@functools.lru_cache(maxsize=1024)   # the advisor asks for each candidate's many times
def _stage_blocks(spec: ModelSpec, pp: int, virtual: int, cuts: tuple[int, ...] | None,
                  balance: str) -> tuple[int, ...]:
    stages = pp * virtual
    if pp == 1 or stages > spec.layers + 2:   # (the pipeline refuses the latter)
        return (math.ceil(spec.layers / pp),) * pp
    if cuts:
        bounds = [0, *cuts, spec.layers + 2]
    else:
        bounds = balanced_cuts(layer_weights(spec, balance), stages)
    return tuple(blocks_per_rank(bounds, pp))


def most_blocks(spec: ModelSpec, plan: Plan) -> int:
    """The most blocks any pp rank holds: what prices work done once per block held."""
    return max(stage_blocks(spec, plan))
