"""Cutting a model's layers into pipeline stages: pure functions, no process group.

The layers are `list(model)` for an `nn.Sequential`, or `model.layers()` for a model that
exposes them (meshtrain's GPT: `[embed, *blocks, head]`), or a transformers causal LM's
stages (models/hf.py: embedding, each decoder layer, head); run one after another they must
compute `model.forward`. They are cut into S = pp * virtual_stages consecutive stages, each
at least one layer, balanced by parameter count unless explicit cut points are given.
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.plan import Plan, PlanError
from meshtrain.models.structure import pipeline_layers


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in the order that computes its forward."""
    layers = pipeline_layers(model)
    if not layers:
        raise PlanError(f"pipeline parallel cuts a model's layers into stages, but "
                        f"{type(model).__name__} exposes no layers: pass an nn.Sequential, "
                        "or give the model a layers() method returning its layers in the "
                        "order that computes forward (as meshtrain's GPT does)")
    return layers


def balanced_cuts(weights: list[int], stages: int) -> list[int]:
    """Boundaries [0, c1, ..., len(weights)] of `stages` consecutive non-empty groups whose
    heaviest group is as light as possible (linear partition, by dynamic programming)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest group splitting the first i layers into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def stage_bounds(model: nn.Module, plan: Plan, cuts: list[int] | None = None) -> list[int]:
    """[0, ..., n_layers]: stage s runs layers[bounds[s]:bounds[s+1]]. `cuts` are the S-1
    inner boundaries (the index of the first layer of stages 1..S-1); by default the
    stages are balanced by parameter count. Refuses, naming the values, a split that
    cannot be made."""
    layers = model_layers(model)
    stages = plan.pp * plan.virtual_stages
    if stages > len(layers):
        raise PlanError(f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {stages} "
                        f"stages, but {type(model).__name__} has only {len(layers)} layers; "
                        f"use at most {len(layers)} stages (each stage needs a layer)")
    if cuts is None:
        counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        return balanced_cuts(counts, stages)
    bounds = [0, *cuts, len(layers)]
    if len(cuts) != stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(f"stage_cuts={list(cuts)}: give {stages - 1} increasing layer "
                        f"indices between 1 and {len(layers) - 1} (where stages 1..{stages - 1} "
                        "start)")
    return bounds


def check(model: nn.Module, plan: Plan, cuts: list[int] | None = None) -> None:
    """Every refusal that needs no process group: a model without layers, more stages
    than layers, bad cut points, parameters that no layer holds."""
    if plan.pp == 1:   # stage_cuts without pp: core/admit.check_plan refuses them
        return
    stage_bounds(model, plan, cuts)
    in_layers = {id(p) for layer in model_layers(model) for p in layer.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in in_layers]
    if outside:
        raise PlanError(f"pipeline parallel runs only the model's layers, but parameters "
                        f"{outside[:3]} belong to none of them; put them inside a layer")
