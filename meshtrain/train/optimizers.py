"""The optimizers `meshtrain train` builds: AdamW (the default) in torch's fastest
implementation for where its parameters live: fused (one kernel per step) when all are on
CUDA, foreach (one multi-tensor op per group) otherwise (CPU, or ZeRO's CPU-offloaded
states); or SGD with momentum (`--optimizer sgd`), the setting of the papers that
error-feedback compression such as PowerSGD was built and measured in."""
from __future__ import annotations

import torch


def fastest_implementation(params: list) -> dict:
    """torch.optim keyword for AdamW or SGD: {"fused": True} when every parameter is a floating
    CUDA tensor, else {"foreach": True}."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if tensors and all(t.is_cuda and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {"foreach": True}


def default_adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                             **fastest_implementation(params))


def run_optimizer(params, name: str, lr: float, weight_decay: float, momentum: float
                  ) -> torch.optim.Optimizer:
    """`meshtrain train --optimizer NAME`: "adamw" (with `weight_decay`) or "sgd" (with
    `momentum`, without weight decay)."""
    if name == "sgd":
        params = list(params)
        return torch.optim.SGD(params, lr=lr, momentum=momentum,
                               **fastest_implementation(params))
    return default_adamw(params, lr, weight_decay)
