"""Where context parallel meets a model: its attention replaced, its positions made global.
Nothing in a model's code changes; each replacement goes through what the model exposes.

- meshtrain's GPT: each block's `AttentionCore` (softmax(q k^T / sqrt(hs)) v, causal) is
  swapped for `ContextAttention`, and the position embedding reads each local token's place
  in the whole sequence (a forward pre-hook on `embed.pos`, whose input is arange(2c)).
- a transformers model: an attention function registered in transformers'
  `AttentionInterface` (`ALL_ATTENTION_FUNCTIONS`) and selected with
  `set_attn_implementation`, and `position_ids` given to its forward (RoPE and learned
  positions read them). Its own causal mask is not built: a registered function that
  transformers has no mask for gets none, and the causal mask comes from the chunks.
"""
from __future__ import annotations

import itertools
import math

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import Plan, PlanError
from meshtrain.models import hf
from meshtrain.models.gpt import GPT, AttentionCore
from meshtrain.models.hf_stages import GLOBAL_POSITIONS
from meshtrain.strategies.context_parallel.all_to_all import all_to_all_attention
from meshtrain.strategies.context_parallel.layout import ChunkLayout
from meshtrain.strategies.context_parallel.ring import ring_attention

STYLES = {"ring": ring_attention, "all-to-all": all_to_all_attention}
_registered = itertools.count()   # each Trainer's attention function under a name of its own


def check_model(model: nn.Module, plan: Plan) -> None:
    """Refuse, by name, a model whose attention meshtrain cannot replace, or whose heads
    (each tp rank's share of them) all-to-all cannot scatter over cp."""
    cp, style, tp = plan.cp, plan.cp_style, plan.tp
    if isinstance(model, GPT):
        heads = kv_heads = model.config.n_head
    elif hf.is_causal_lm(model):
        heads, kv_heads = _check_transformers(model)
    else:
        raise PlanError(f"context parallel replaces attention, but {type(model).__name__} "
                        "exposes none meshtrain can replace: use meshtrain's GPT or a "
                        "transformers causal LM (its attention-function interface), or cp=1")
    heads, kv_heads = heads // tp, max(1, kv_heads // tp)   # each tp rank's
    if style == "all-to-all" and (heads % cp or kv_heads % cp):
        each = f" on each of tp={tp} ranks" if tp > 1 else ""
        raise PlanError(f"cp_style='all-to-all' scatters the attention heads over cp={cp}, "
                        f"but the model has {heads} heads and {kv_heads} key/value heads"
                        f"{each}; use a cp that divides both, or cp_style='ring'")


def _check_transformers(model: nn.Module) -> tuple[int, int]:
    config, name = model.config, type(model).__name__
    if not model._can_set_attn_implementation():
        raise PlanError(f"context parallel replaces attention through transformers' "
                        f"attention-function interface, which {name} does not use; use a "
                        "model that does (Llama, Qwen2, Mistral, GPT-2, ...), or cp=1")
    # sliding windows and soft-capped scores come with each call (per layer): built
    if getattr(config, "use_bidirectional_attention", False):
        raise PlanError(f"context parallel with {name}'s use_bidirectional_attention=True: "
                        "its attention is causal only; set use_bidirectional_attention="
                        "False, or cp=1")
    for field in ("attention_dropout", "attn_pdrop"):
        if getattr(config, field, 0.0):
            raise PlanError(f"context parallel with {name}'s {field}="
                            f"{getattr(config, field)!r}: attention dropout is not built "
                            f"under cp (the ring and the all-to-all drop no probability); "
                            f"set {field}=0.0, or cp=1")
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    return heads, getattr(config, "num_key_value_heads", None) or heads


class ContextAttention(nn.Module):
    """The GPT's attention core over a sequence split across cp (same inputs, no
    parameters): q, k, v (B, nh, 2c, hs) -> (B, nh, 2c, hs)."""

    def __init__(self, comm: Comm, layout: ChunkLayout, style: str) -> None:
        super().__init__()
        self.comm, self.layout, self.style = comm, layout, style

    def forward(self, q, k, v):
        return STYLES[self.style](q, k, v, self.comm, self.layout, 1.0 / math.sqrt(q.size(-1)))

    def extra_repr(self) -> str:
        return f"{self.style}, cp={self.layout.rank}/{self.layout.size}"


def replace_attention(model: nn.Module, comm: Comm, layout: ChunkLayout, style: str) -> None:
    """Swap the model's attention for one across cp, and give it global positions."""
    if isinstance(model, GPT):
        for module in list(model.modules()):
            for child_name, child in module.named_children():
                if isinstance(child, AttentionCore):
                    setattr(module, child_name, ContextAttention(comm, layout, style))
        model.embed.pos.register_forward_pre_hook(_gpt_positions(layout))
        return
    name = f"meshtrain-cp-{next(_registered)}"
    function = STYLES[style]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, sliding_window=None, softcap=None, **kwargs):
        _refuse_unbuilt(module, is_causal, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.size(-1))
        out = function(query, key, value, comm, layout, scale,      # (B, H, 2c, D)
                       window=sliding_window, softcap=softcap)      # this layer's
        return out.transpose(1, 2).contiguous(), None               # (B, 2c, H, D)

    from transformers import AttentionInterface
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    model.register_forward_pre_hook(_transformers_positions(layout), with_kwargs=True)
    # pipeline stages run the base model's forward on a proxy, past this hook: they read it
    setattr(model, GLOBAL_POSITIONS,
            lambda length, device: layout.positions(length, device).unsqueeze(0))


UNBUILT = {"s_aux": "attention sinks", "position_bias": "an additive position bias"}


def _refuse_unbuilt(module: nn.Module, is_causal, kwargs: dict) -> None:
    """A call asking for what the cp kernels do not compute (they are causal softmax
    attention, windowed and capped): raise rather than train a different model."""
    asked = [f"{UNBUILT[k]} ({k})" for k in UNBUILT if kwargs.get(k) is not None]
    if is_causal is False or not getattr(module, "is_causal", True):
        asked.append("bidirectional attention (is_causal=False)")
    if asked:
        raise ValueError(f"context parallel's attention is causal, with a sliding window "
                         f"and soft-capped scores at most; {type(module).__name__} asks for "
                         f"{', '.join(asked)}, not built under cp: use cp=1")


def _gpt_positions(layout: ChunkLayout):
    def hook(embedding: nn.Embedding, args):
        (local,) = args                                            # arange(2c)
        positions = layout.positions(local.numel(), local.device)
        if layout.size * local.numel() > embedding.num_embeddings:
            raise ValueError(f"sequence length {layout.size * local.numel()} exceeds the "
                             f"model's seq_len={embedding.num_embeddings}; crop the input or "
                             "build the model with a larger GPTConfig.seq_len")
        return (positions,)
    return hook


def _transformers_positions(layout: ChunkLayout):
    def hook(model: nn.Module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]             # (B, 2c)
        kwargs["position_ids"] = layout.positions(ids.size(1), ids.device).unsqueeze(0)
        return args, kwargs
    return hook
