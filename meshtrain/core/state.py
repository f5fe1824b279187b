"""The one-process state, rebuilt from the pieces the slots hold, and split back into them.

`full_state_dict()`, checkpoints and the equivalence tests speak one format whatever the
plan: the model's own `state_dict()` keys and full shapes, and the optimizer's state keyed by
parameter name, as one process would hold it:

    {"state": {name: {"exp_avg": full tensor, "step": 0-dim tensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [name, ...]}]}

[Note: from a rank's pieces to the one-process state]
Each slot converts between its own layout and the next one's, always per parameter name:
- gradient sync (slots 3-4) gives this rank's parameters and their optimizer states as
  per-parameter tensors, whatever it keeps (DDP: the tensors themselves; ZeRO: cut out of
  its flat shards after an all-gather over dp);
- layer sharding (slot 1) turns this rank's tensor-parallel slices into full tensors (an
  all-gather over tp), and back (a slice);
- stages (slot 2) merge what each pipeline stage holds into every name (over pp), and keep
  only this stage's names on the way back.
Splitting a full state back runs the same chain in reverse, with no communication. A
resumed rank reads of a checkpoint only its part: each slot names its region of a whole
tensor (core/regions.py, train/resume.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StateLayout:
    """The one-process state dict's names, recorded before any slot changes the model.

    `canonical[key]` is the name of the tensor a state-dict key refers to: a parameter
    shared by two modules (tied weights) appears under several keys but is one tensor,
    named by its first key (as `named_parameters()` names it)."""
    keys: list[str]
    canonical: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    parameters: list[str]          # canonical names of the parameters, in model order

    @classmethod
    def of(cls, model: nn.Module) -> "StateLayout":
        first_name: dict[int, str] = {}
        canonical, shapes = {}, {}
        state = model.state_dict(keep_vars=True)
        for key, tensor in state.items():
            name = first_name.setdefault(id(tensor), key)
            canonical[key] = name
            shapes[key] = tuple(tensor.shape)
        parameters = [first_name.get(id(p), n) for n, p in model.named_parameters()]
        return cls(list(state), canonical, shapes, parameters)

    def expand(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical names -> every state-dict key (tied tensors under each of their keys)."""
        return {key: tensors[self.canonical[key]] for key in self.keys}
