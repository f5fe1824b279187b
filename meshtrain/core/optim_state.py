"""A torch optimizer's state and hyper-parameters by parameter name, and back.

torch keys an optimizer's state by parameter object (and its state_dict by position); the
one-process format meshtrain consolidates and checkpoints keys it by parameter name, so that
any plan can read what any other wrote.
"""
from __future__ import annotations

import torch
from torch import nn


def param_groups_by_name(optimizer: torch.optim.Optimizer,
                         names: dict[int, str]) -> list[dict]:
    """The optimizer's hyper-parameters per group, its parameters given by name."""
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [names[id(p)] for p in group["params"] if id(p) in names]}
            for group in optimizer.param_groups]


def state_by_name(optimizer: torch.optim.Optimizer,
                  names: dict[int, str]) -> dict[str, dict[str, object]]:
    """The optimizer's per-parameter state keyed by parameter name (tensors not copied)."""
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


def flat_state_by_name(optimizer: torch.optim.Optimizer, state: dict[str, dict],
                       stepped: set[str], names: list[str]) -> tuple[dict[str, dict], list[dict]]:
    """The one-process format of a strategy whose optimizer steps flat shards (one group):
    the per-name `state` it rebuilt, without the parameters never stepped (in one process a
    parameter whose .grad was always None has no state), and the group's hyper-parameters
    over every name."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return ({n: s for n, s in state.items() if s and n in stepped},
            [{**group, "params": list(names)}])


def load_state_by_name(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                       state: dict[str, dict], groups: list[dict]) -> None:
    """Put per-name states into `optimizer` (whose parameters are `params`, by name), with
    the hyper-parameters of the saved group each parameter was in."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                            for p in g["params"])}
    name_of = {id(p): n for n, p in params.items()}
    saved_group_of = {name: g for g in groups for name in g["params"]}
    out_groups = []
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        saved = next((saved_group_of[n] for n in names if n in saved_group_of), None)
        hyper = {k: v for k, v in (saved or group).items() if k != "params"}
        out_groups.append({**hyper, "params": [index[id(p)] for p in group["params"]]})
    out_state = {index[id(params[n])]: s for n, s in state.items() if n in params}
    optimizer.load_state_dict({"state": out_state, "param_groups": out_groups})
