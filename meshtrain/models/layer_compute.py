"""Training FLOPs per token of each of a model's pipeline layers, read from the layers'
modules: what a pipeline balances its stages by (strategies/pipeline/partition.py; the
planner counts the same from a model spec, planner/stage_split.py).

Per layer (core/stage_split.py's formulas): 6 x the weights of its matmuls (nn.Linear,
transformers' Conv1D; a mixture's experts at top_k / experts of their size: idle experts do
no work; an nn.Embedding 0: a lookup), 12 x seq x width per attention module (a module whose
class name ends in "Attention", outermost only), and on the last layer of a model with a
vocabulary the loss. A weight shared by two layers counts where it multiplies: a tied head's
Linear holds the embedding's matrix, so the head carries it and the embedding nothing.
`seq` is the context the model is configured for (GPTConfig.seq_len, a transformers config's
max_position_embeddings) unless given.
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.stage_split import LOSS_FLOPS_PER_LOGIT, block_flops
from meshtrain.models.experts import experts_modules
from meshtrain.models.moe import router_of


def layer_flops(model: nn.Module, layers: list[nn.Module], seq: int | None = None) -> list[float]:
    """Training FLOPs per token of each layer in `layers` (the model's pipeline layers)."""
    width, context, vocab = _shape(model)
    seq = seq or context
    router = router_of(model)
    out = []
    for layer in layers:
        matmul = sum(m.weight.numel() for m in layer.modules()
                     if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        if router is not None:   # packed experts hold parameters, not Linears
            for experts in experts_modules(layer).values():
                size = sum(p.numel() for p in experts.parameters())
                matmul += size * router.top_k / router.experts
        out.append(block_flops(matmul, _attentions(layer), seq, width))
    if layers and vocab:
        out[-1] += LOSS_FLOPS_PER_LOGIT * vocab
    return out


def _shape(model: nn.Module) -> tuple[int, int, int]:
    """(attention's query width, the context, the vocabulary) from the model's config; 0
    where it has none (an nn.Sequential: matmuls only)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 0, 0, 0
    if hasattr(cfg, "d_model") and hasattr(cfg, "seq_len"):   # meshtrain's GPTConfig
        return cfg.d_model, cfg.seq_len, cfg.vocab_size
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    hidden = getattr(cfg, "hidden_size", 0) or 0
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads else 0)
    return (heads * head_dim, getattr(cfg, "max_position_embeddings", 0) or 0,
            getattr(cfg, "vocab_size", 0) or 0)


def _attentions(layer: nn.Module) -> int:
    names = [n for n, m in layer.named_modules() if type(m).__name__.endswith("Attention")]
    return sum(1 for n in names
               if not any(n.startswith(o + "." if o else "") for o in names if o != n))
