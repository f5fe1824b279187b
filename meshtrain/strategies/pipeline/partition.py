"""Cutting a model's layers into pipeline stages: pure functions, no process group.

The layers are `list(model)` for an `nn.Sequential`, or `model.layers()` for a model that
exposes them (meshtrain's GPT: `[embed, *blocks, head]`), or a transformers causal LM's
stages (models/hf.py: embedding, each decoder layer, head); run one after another they must
compute `model.forward`. They are cut into S = pp * virtual_stages consecutive stages, each
at least one layer, balanced by each layer's training FLOPs (models/layer_compute.py: the
embedding ~0, the head's matmul and the loss; Plan.stage_balance="compute") or by its
parameter count ("parameters": memory), unless explicit cut points are given. The planner
makes the same cut from a model spec (core/stage_split.balanced_cuts).
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.plan import Plan, PlanError
from meshtrain.core.stage_split import balanced_cuts
from meshtrain.models.layer_compute import layer_flops
from meshtrain.models.structure import pipeline_layers

__all__ = ["balanced_cuts", "check", "layer_weights", "model_layers", "stage_bounds"]


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in the order that computes its forward."""
    layers = pipeline_layers(model)
    if not layers:
        raise PlanError(f"pipeline parallel cuts a model's layers into stages, but "
                        f"{type(model).__name__} exposes no layers: pass an nn.Sequential, "
                        "or give the model a layers() method returning its layers in the "
                        "order that computes forward (as meshtrain's GPT does)")
    return layers


def stage_bounds(model: nn.Module, plan: Plan, cuts: list[int] | None = None) -> list[int]:
    """[0, ..., n_layers]: stage s runs layers[bounds[s]:bounds[s+1]]. `cuts` are the S-1
    inner boundaries (the index of the first layer of stages 1..S-1); by default the
    stages are balanced by `plan.stage_balance`. Refuses, naming the values, a split that
    cannot be made."""
    layers = model_layers(model)
    stages = plan.pp * plan.virtual_stages
    if stages > len(layers):
        raise PlanError(f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {stages} "
                        f"stages, but {type(model).__name__} has only {len(layers)} layers; "
                        f"use at most {len(layers)} stages (each stage needs a layer)")
    if cuts is None:
        return balanced_cuts(layer_weights(model, layers, plan.stage_balance), stages)
    bounds = [0, *cuts, len(layers)]
    if len(cuts) != stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(f"stage_cuts={list(cuts)}: give {stages - 1} increasing layer "
                        f"indices between 1 and {len(layers) - 1} (where stages 1..{stages - 1} "
                        "start)")
    return bounds


def layer_weights(model: nn.Module, layers: list[nn.Module], balance: str) -> list[float]:
    """What each layer weighs in the balance: its training FLOPs per token ("compute") or
    its parameter count ("parameters")."""
    if balance == "parameters":
        return [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return layer_flops(model, layers)


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
