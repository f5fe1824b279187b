"""Training FLOPs per token of each of a model's pipeline layers in their matmuls, read from
the layers' modules: what a pipeline balances its stages by (strategies/pipeline/
partition.py; the planner counts the same from a model spec, planner/stage_split.py).

Per layer (core/stage_split.py): 6 x the weights of its matmuls (nn.Linear, transformers'
Conv1D; a mixture's experts at top_k / experts of their size: idle experts do no work; an
nn.Embedding 0: a lookup), and on the last layer of a model with a vocabulary the loss. A
weight shared by two layers counts where it multiplies: a tied head's Linear holds the
embedding's matrix, so the head carries it and the embedding nothing.
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.stage_split import LOSS_FLOPS_PER_LOGIT, TRAIN_FLOPS_PER_WEIGHT
from meshtrain.models.experts import experts_modules
from meshtrain.models.moe import router_of


def layer_flops(model: nn.Module, layers: list[nn.Module]) -> list[float]:
    """Training FLOPs per token of each layer in `layers` (the model's pipeline layers)."""
    router = router_of(model)
    out = []
    for layer in layers:
        matmul = sum(m.weight.numel() for m in layer.modules()
                     if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        if router is not None:   # packed experts hold parameters, not Linears
            for experts in experts_modules(layer).values():
                size = sum(p.numel() for p in experts.parameters())
                matmul += size * router.top_k / router.experts
        out.append(TRAIN_FLOPS_PER_WEIGHT * matmul)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    if layers and vocab:
        out[-1] += LOSS_FLOPS_PER_LOGIT * vocab
    return out
