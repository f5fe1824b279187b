"""Tensor parallel (slot 1 on the tp axis): each layer's matrices split across the tp ranks.

    communications.py  the collectives as autograd functions (copy_to / reduce_from / scatter /
                       gather, and the sequence-parallel all-gather / reduce-scatter)
    layers.py          ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    sequence.py        sequence parallel's column matmul: saves the input's slice, regathers it
    cross_entropy.py   the vocab-parallel cross-entropy (never the full logits on one rank)
    sharder.py         swaps a model's layers for those, in place, from the whole weights
    sharding.py        TensorParallel: the LayerSharding slot (full / local / counts / ...)
    gpt.py             meshtrain's GPT natively, with or without sequence parallel
    tp_plan.py         any model through a tp_plan of module-name patterns -> styles
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import Plan, PlanError
from meshtrain.strategies.tensor_parallel.cross_entropy import token_cross_entropy
from meshtrain.strategies.tensor_parallel.sharding import TensorParallel

__all__ = ["check", "shard", "token_cross_entropy", "TensorParallel"]


def check(model: nn.Module, plan: Plan, tp_plan: dict | None) -> None:
    """Every refusal that needs no process group: heads and widths tp does not divide, a
    tp_plan pattern matching nothing or a module of the wrong kind, sequence parallel
    where it is not built."""
    from meshtrain.models import hf
    from meshtrain.models.gpt import GPT
    from meshtrain.strategies.tensor_parallel import gpt, tp_plan as plan_module

    if plan.tp == 1:
        return
    if tp_plan is not None:
        if plan.sequence_parallel and not (hf.is_causal_lm(model) and plan.pp == 1):
            raise PlanError("sequence_parallel=True is built for meshtrain's GPT and, with a "
                            "tp_plan, for transformers causal LMs without pipeline stages "
                            f"(pp=1); for this {type(model).__name__} with pp={plan.pp}, drop "
                            "sequence_parallel")
        if hf.is_causal_lm(model):   # a tp_plan of its own still splits whole heads
            hf.check_heads(model, plan.tp)
        plan_module.resolve(model, tp_plan, plan.tp)
    elif isinstance(model, GPT):
        gpt.check_gpt(model.config, plan.tp)
    else:
        raise PlanError(f"tensor parallel shards meshtrain's GPT natively; for a "
                        f"{type(model).__name__} pass tp_plan={{'module-name pattern': "
                        f"'column' | 'row' | 'qkv' | 'vocab' | 'column_gather' | 'row_split' | "
                        "'replicated', ...} in the Plan")


def shard(model: nn.Module, plan: Plan, comm: Comm, tp_plan: dict | None) -> TensorParallel:
    """Shard `model` in place over the tp axis: natively (the GPT) or through `tp_plan`."""
    from meshtrain.strategies.tensor_parallel import gpt, tp_plan as plan_module

    from meshtrain.models import hf, hf_plans

    check(model, plan, tp_plan)
    if tp_plan is not None:
        sequence = (plan_module.SequenceSplit(hf_plans.sequence_stream(model))
                    if plan.sequence_parallel and hf.is_causal_lm(model) else None)
        return plan_module.shard_with_plan(model, comm, tp_plan, sequence)
    return gpt.shard_gpt(model, comm, plan.sequence_parallel)
