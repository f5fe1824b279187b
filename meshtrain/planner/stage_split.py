"""Which blocks each pipeline rank holds, as the pipeline cuts them (strategies/pipeline/
partition.py): the same partition (core/stage_split.balanced_cuts) of the same layer list
[embedding, block x layers, head], weighed from the model spec instead of the modules, so
memory and time are priced for the stages the runtime builds."""
from __future__ import annotations

import math

from meshtrain.core.plan import Plan
from meshtrain.core.stage_split import (LOSS_FLOPS_PER_LOGIT, balanced_cuts, block_flops,
                                        blocks_per_rank)
from meshtrain.planner.model_spec import ModelSpec


def layer_weights(spec: ModelSpec, balance: str) -> list[float]:
    """Each pipeline layer's weight in the balance: training FLOPs per token ("compute":
    the embedding's lookup 0, a block's matmuls (a mixture's active experts) and attention,
    the head's matmul (tied or not: it multiplies) and the loss) or parameters."""
    if balance == "parameters":   # a tied matrix is a parameter of both the layers
        head = spec.head_params + (spec.vocab * spec.hidden if spec.tied else 0)
        return [spec.embedding_params, *[spec.layer_params] * spec.layers, head]
    block = block_flops(spec.layer_matmul_params, 1, spec.span, spec.hidden)
    head = 6 * spec.hidden * spec.vocab + LOSS_FLOPS_PER_LOGIT * spec.vocab
    return [0, *[block] * spec.layers, head]


def stage_blocks(spec: ModelSpec, plan: Plan) -> list[int]:
    """Blocks on each of the plan's pp ranks (virtual stages summed): its stage_cuts, else
    the stages balanced by its stage_balance."""
    stages = plan.pp * plan.virtual_stages
    if plan.pp == 1 or stages > spec.layers + 2:
        return [math.ceil(spec.layers / plan.pp)] * plan.pp
    if plan.stage_cuts:
        bounds = [0, *plan.stage_cuts, spec.layers + 2]
    else:
        bounds = balanced_cuts(layer_weights(spec, plan.stage_balance), stages)
    return blocks_per_rank(bounds, plan.pp)
