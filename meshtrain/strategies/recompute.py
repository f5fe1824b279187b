"""Activation recomputation (`Plan(recompute="full" | "selective")`): keep less for backward,
compute it again when backward needs it (Chen et al. 2016; Korthikanti et al. 2022).

- "full": every transformers decoder layer, or every element of the model's `layers()` or
  child but the last (models/structure.py), keeps only its input; its forward runs again
  inside backward. Per transformer layer that
  leaves s*b*h elements of the 34 s*b*h (16 in fp32, without dropout) a layer saves.
- "selective": only the attention core (softmax(QK^T)V) is recomputed: what it keeps that
  grows with s^2 is dropped (Korthikanti et al. §4). A model must expose its cores as modules
  (meshtrain's GPT: `AttentionCore`). With a fused attention kernel the core keeps no s^2
  tensor in the first place, so selective saves nearly nothing there (the planner's formula
  says the same) and only costs the core's recomputation.
A `layers()` list's or children's last (the output layer and loss) is not wrapped: its
backward follows its forward at once. A transformers model's output layer is not among its
decoder layers, so all of those are (as Megatron and transformers' own gradient
checkpointing do, and as the planner counts).

Built on torch.utils.checkpoint (non-reentrant): a wrapped module's forward runs through
`checkpoint`, its hooks (ZeRO-3's gathers) stay outside it.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtrain.core.plan import PlanError
from meshtrain.models import hf
from meshtrain.models.structure import units_of


def apply_recompute(model: nn.Module, mode: str, keep: Callable | None = None) -> list[str]:
    """Wrap the modules `mode` recomputes, in place; returns their names. `keep(tensors)` is
    told which inputs a wrapped module holds for backward (activation accounting)."""
    if mode == "none":
        return []
    names = {id(m): n for n, m in model.named_modules()}
    if mode == "full":
        decoder = hf.decoder_layers(model)
        layers = decoder if decoder is not None else units_of(model)[:-1]
        modules = [m for m in layers if any(True for _ in m.modules())]
    else:
        modules = [m for m in model.modules() if type(m).__name__ == "AttentionCore"]
        if not modules:
            raise PlanError(f"recompute='selective' recomputes attention cores, and "
                            f"{type(model).__name__} exposes none (an AttentionCore module, as "
                            "meshtrain's GPT has); use recompute='full'")
    for module in modules:
        module.forward = partial(_recomputed, module.forward, keep)
    return [names[id(m)] for m in modules]


def _recomputed(forward: Callable, keep: Callable | None, *args, **kwargs):
    if keep is not None:
        keep([a for a in args if isinstance(a, torch.Tensor)])
    if not torch.is_grad_enabled():   # nothing will be recomputed: run it plainly
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
