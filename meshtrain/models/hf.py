"""transformers causal LMs as `from_config` / `from_pretrained` build them: what meshtrain
reads from their structure so that no wrapper, tp_plan or loss is needed.

- the loss: next-token cross-entropy on the output's `.logits` (`token_cross_entropy`);
- `decoder_layers`: the list of decoder layers (the ModuleList the config's
  `base_model_pp_plan` names, else `model.layers` / `transformer.h`): the units of
  recomputation and of ZeRO-3's gathers;
- `stage_layers`: the model as a list of registered modules that, run one after another,
  compute its logits (embedding, one per decoder layer, final norm + output layer), each
  running the model's own forward code so that every family's positions, masks and
  scalings are computed where the stage runs (models/hf_stages.py), so a pipeline can cut
  anywhere between decoder layers. They are built fresh from the model's current
  attributes on each call, so they always see the modules tensor parallel swapped in;
- `tp_plan_of`: the model's own `base_model_tp_plan` (its base model under its prefix)
  mapped onto meshtrain's styles, or one derived from its modules (models/hf_plans.py);
  GPT-2's built in.
Non-persistent buffers (RoPE's `inv_freq`) stay non-persistent: every rank keeps its own
copy, and they never enter a checkpoint (they are not in `state_dict()`).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from meshtrain.core.plan import PlanError

GPT2_TP_PLAN = {
    "transformer.wte": "vocab",               # embedding rows split over the vocabulary
    "transformer.h.*.attn.c_attn": "qkv",     # fused q, k, v: each rank its heads' q, k, v
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
    "lm_head": "vocab",                       # tied to wte: logits stay split for the loss
}


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model with an output layer (…ForCausalLM, GPT2LMHeadModel)."""
    transformers = sys.modules.get("transformers")
    return (transformers is not None and isinstance(model, transformers.PreTrainedModel)
            and isinstance(getattr(model, "lm_head", None), nn.Module))


def family(model: nn.Module) -> str:
    return getattr(model.config, "model_type", type(model).__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    """The decoder layers in forward order, or None where the model is not a causal LM
    with a recognisable layer list."""
    from meshtrain.models.hf_stages import layer_list_name

    if not is_causal_lm(model):
        return None
    name = layer_list_name(model)
    return list(getattr(model.base_model, name)) if name is not None else None


def prepare(model: nn.Module) -> None:
    """Training never reads a KV cache: forward without one (a cache would also grow on
    every recomputation)."""
    def no_cache(module, args, kwargs):
        return args, {**kwargs, "use_cache": False}
    model.register_forward_pre_hook(no_cache, with_kwargs=True)


def defaults(model: nn.Module, tp: int, loss_fn, tp_plan: dict | None):
    """(loss_fn, tp_plan) as the Trainer uses them: for a transformers causal LM, the token
    cross-entropy where no loss is given and the model's own tp plan where tp > 1 and none
    is given; anything else as given. Prepares the model for training (no KV cache)."""
    if not is_causal_lm(model):
        return loss_fn, tp_plan
    from meshtrain.models.registry import token_cross_entropy

    prepare(model)
    if tp_plan is None and tp > 1:
        tp_plan = tp_plan_of(model, tp)
    return loss_fn or token_cross_entropy, tp_plan


def tp_plan_of(model: nn.Module, tp: int) -> dict:
    """The model's own tensor-parallel plan in meshtrain's styles: GPT-2's built in; else its
    config's `base_model_tp_plan` under the base model's prefix, or one derived from its
    modules' names where it has none (models/hf_plans.py), with the embedding and the output
    layer vocab-parallel. Refuses heads (query or key/value) that tp does not divide: each
    rank computes whole heads, and grouped-query attention is not replicated."""
    from meshtrain.models.hf_plans import tp_plan_of as own_plan
    from meshtrain.models.hf_stages import layer_list_name

    if family(model) == "gpt2":
        return dict(GPT2_TP_PLAN)
    check_heads(model, tp)
    layers = layer_list_name(model)
    if layers is None:
        raise PlanError(f"{type(model).__name__} ({family(model)!r}) carries no "
                        "base_model_tp_plan and no decoder-layer list to derive one from: pass "
                        "tp_plan={'module-name pattern': 'column' | 'row' | 'qkv' | 'vocab' | "
                        "'column_gather' | 'row_split' | 'replicated'} in "
                        "the Plan (Plan(tp=T, tp_plan=...)), or use tp=1")
    pattern = f"{model.base_model_prefix}.{layers}.*"
    return own_plan(model, tp, (pattern, getattr(model.base_model, layers)[0]))


def check_heads(model: nn.Module, tp: int) -> None:
    """Each tp rank computes whole heads: tp must divide the query heads and the key/value
    heads (grouped-query attention's key/value heads are not replicated)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("attention heads (num_attention_heads)", heads),
                        ("key/value heads (num_key_value_heads)", kv_heads)):
        if isinstance(count, int) and count % tp:
            raise PlanError(f"tp={tp} does not divide the {count} {what} of "
                            f"{type(model).__name__}: each tp rank computes whole heads "
                            f"(key/value heads are not replicated); choose tp dividing {count}")


# ---- pipeline stages ---------------------------------------------------------------------------
def stage_layers(model: nn.Module) -> list[nn.Module]:
    """[embedding, decoder layer 0, ..., decoder layer n-1, head]: run in order they compute
    `model(ids).logits`, each by the model's own forward code (models/hf_stages.py)."""
    from meshtrain.models.hf_stages import stage_layers as stages

    return stages(model)
