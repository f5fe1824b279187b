"""Where a model's layers are, as the strategies that cut or wrap per layer read them.

- `layers_method(model)`: the model's own `layers()` method (meshtrain's GPT: `[embed,
  *blocks, head]`), or None; an attribute named `layers` that is a module (a
  `self.layers = nn.ModuleList(...)`) is not such a method;
- `units_of(model)`: what recomputation and ZeRO-3 treat one at a time: a transformers
  causal LM's decoder layers, else `layers()`, else the model's children;
- `pipeline_layers(model)`: what a pipeline cuts into stages: an `nn.Sequential`'s children,
  `layers()` (a GPT with experts: its layers carrying the routing, models/moe_stages.py),
  or a transformers causal LM's stage modules (models/hf.py); [] if none.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from meshtrain.models import hf
from meshtrain.models.moe_stages import routed_gpt_layers


def layers_method(model: nn.Module) -> Callable | None:
    method = getattr(model, "layers", None)
    return method if callable(method) and not isinstance(method, nn.Module) else None


def units_of(model: nn.Module) -> list[nn.Module]:
    decoder = hf.decoder_layers(model)
    if decoder is not None:
        return decoder
    method = layers_method(model)
    if method is not None:
        return list(method())
    units = []   # a container (ModuleList/ModuleDict) is never called: its elements are
    for child in model.children():
        units += list(child.values() if isinstance(child, nn.ModuleDict) else child) \
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
    return units


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        return list(model)
    carried = routed_gpt_layers(model)   # a GPT with experts: its routing carried
    if carried is not None:
        return carried
    method = layers_method(model)
    if method is not None:
        return list(method())
    if hf.is_causal_lm(model):
        return hf.stage_layers(model)
    return []
