"""A transformers causal LM's tensor-parallel plan in meshtrain's styles: its config's own
`base_model_tp_plan` mapped style by style, or, for a family that carries none, one derived
from its modules' names, said aloud, and refused by name where the names do not settle it.

transformers' style          meshtrain's (strategies/tensor_parallel/tp_plan.py)
  colwise                      column
  rowwise                      row
  colwise_gather_output        column_gather (vocab on the output layer: logits stay split)
  rowwise_split_input          row_split
  embedding_rowwise            vocab
  replicated_with_grad_allreduce  replicated
Every other style (packed projections, latent attention...) is refused naming the module
and the style, except a mixture of experts' experts: they stay whole on every tp rank (the
entries under an `experts` module are dropped), split over ep ranks where Plan.ep > 1
(strategies/expert_parallel). The embedding and the output layer are always vocab-parallel.
"""
from __future__ import annotations

import fnmatch
import warnings

from torch import nn

from meshtrain.core.plan import PlanError

STYLE_OF = {"colwise": "column", "rowwise": "row", "colwise_gather_output": "column_gather",
            "rowwise_split_input": "row_split", "embedding_rowwise": "vocab",
            "replicated_with_grad_allreduce": "replicated"}
# projections known by name inside a decoder layer: those reading the block's input,
# fused ones (q/k/v or gate/up in one matrix, gathered whole: any layout is then right) and
# those writing the block's output
ATTENTION = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}
FUSED = {"qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "gate_up_proj"}
READS = ATTENTION | FUSED | {"gate_proj", "up_proj", "fc1", "fc_in", "c_fc", "dense_h_to_4h",
                             "w1", "w3"}
WRITES = {"o_proj", "out_proj", "dense", "c_proj", "down_proj", "fc2", "fc_out",
          "dense_4h_to_h", "w2", "wo"}


class DerivedTpPlanNotice(UserWarning):
    """A tp plan meshtrain derived for a model whose config carries none, said once."""


def tp_plan_of(model: nn.Module, tp: int, derive_layers) -> dict:
    """The model's plan in meshtrain's styles (see the module docstring); `derive_layers`:
    (the decoder layers' name pattern, their first layer) where the config has no plan."""
    base_plan = getattr(model.config, "base_model_tp_plan", None)
    prefix = model.base_model_prefix
    if base_plan:
        plan = {}
        names = [n for n, _ in model.named_modules()]
        for pattern, style in base_plan.items():
            if ".experts" in f".{pattern}":   # experts whole over tp (the module docstring)
                continue
            if not fnmatch.filter(names, f"{prefix}.{pattern}"):
                continue   # a module this config does not build (Qwen3-MoE's dense MLPs)
            if style not in STYLE_OF:
                raise PlanError(f"{type(model).__name__}'s base_model_tp_plan[{pattern!r}] = "
                                f"{style!r}: meshtrain maps only {', '.join(STYLE_OF)}; pass "
                                "Plan(tp_plan=...) instead, or use tp=1")
            plan[f"{prefix}.{pattern}"] = STYLE_OF[style]
    else:
        plan = derive(model, *derive_layers)
    embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    plan[embed] = "vocab"
    plan["lm_head"] = "vocab"   # logits stay split for the vocab-parallel loss
    if not base_plan:
        shown = "\n".join(f"    {k!r}: {v!r}," for k, v in plan.items())
        warnings.warn(DerivedTpPlanNotice(
            f"{type(model).__name__} ({model.config.model_type!r}) carries no "
            f"base_model_tp_plan; meshtrain derived this one from its modules' names (pass "
            f"Plan(tp_plan=...) to use another):\n{{\n{shown}\n}}"), stacklevel=2)
    return plan


def derive(model: nn.Module, pattern: str, layer: nn.Module) -> dict:
    """The plan of one decoder layer, as patterns over every layer (`pattern` ends in `*`):
    in each module holding projections, the ones reading its input "column" and the one
    writing its output "row" (an MLP: an element-wise activation between them). Attention,
    a fused projection or a module with parameters beside them (a q/k norm) get
    "column_gather" / "row_split": how a family's attention reshapes its heads (by a head
    count it keeps whole, at fixed offsets) is its own code, so it runs whole on every rank
    while its projections stay split."""
    plan, unknown = {}, []
    for parent_name, parent in layer.named_modules():
        linears = {n: m for n, m in parent.named_children() if isinstance(m, nn.Linear)}
        if not linears:
            continue
        others = [n for n, m in parent.named_children()
                  if n not in linears and any(True for _ in m.parameters())]
        reads = [n for n in linears if n in READS]
        writes = [n for n in linears if n in WRITES]
        strange = [n for n in linears if n not in reads and n not in writes]
        where = f"{pattern}.{parent_name}." if parent_name else f"{pattern}."
        if strange or len(writes) != 1 or not reads:
            unknown += [where + n for n in (strange or linears)]
            continue
        gather = bool(others) or any(n in FUSED or n in ATTENTION for n in reads)
        for n in reads:
            plan[where + n] = "column_gather" if gather else "column"
        plan[where + writes[0]] = "row_split" if gather else "row"
    if unknown or not plan:
        shown = "".join(f"\n    {k!r}: {v!r}," for k, v in plan.items())
        shown += "".join(f"\n    {k!r}: 'column' | 'row' | 'column_gather' | 'row_split',"
                         for k in unknown)
        raise PlanError(f"{type(model).__name__} ({model.config.model_type!r}) carries no "
                        f"base_model_tp_plan, and its projections {unknown or 'none'} are not "
                        "named so that meshtrain can tell which read a block's input and "
                        "which write its output; pass the plan in Plan(tp_plan={...}), e.g."
                        f" {{{shown}\n}} (plus the embedding and lm_head as 'vocab')")
    return plan


def sequence_stream(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, between which sequence parallel splits the residual stream:
    what comes before (embedding, positions, masks) and after (final norm, output layer)
    sees the whole sequence, so the family's own code computes them as it would."""
    from meshtrain.models.hf_stages import layer_list_name

    return list(getattr(model.base_model, layer_list_name(model)))
