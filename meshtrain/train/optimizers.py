"""The default optimizer `meshtrain train` builds: AdamW in torch's fastest implementation for
where its parameters live: fused (one kernel per step) when all are on CUDA, foreach (one
multi-tensor op per group) otherwise (CPU, or ZeRO's CPU-offloaded states)."""
from __future__ import annotations

import torch


def adamw_implementation(params: list) -> dict:
    """{'fused': True} when every parameter is a floating CUDA tensor, else {'foreach': True}."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if tensors and all(t.is_cuda and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {"foreach": True}


def default_adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                             **adamw_implementation(params))
