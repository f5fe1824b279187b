"""Each rank's share of the consolidated state a checkpoint writes (`Trainer.save`).

[Note: even shares]
The n ranks of a pipeline stage (its replicas x tp) write its state between them. The state
is consolidated a group at a time (`GradientSync.local_state_groups`: ZeRO a bucket, ZeRO-3
a unit; tp slices gathered per tensor), and of each tensor every rank keeps a contiguous
range of rows (dim 0; rank i rows [i*R//n, (i+1)*R//n)), copied to host memory, before the
group is dropped: a rank holds its share plus one consolidated group, never the state.
DCP records each range at its offset in the whole tensor (`placed`, as it records a
sharded DTensor's chunks), so the checkpoint stays the whole, plan-independent state.
A parameter with its states under `WHOLE_BELOW` bytes, or with fewer rows than ranks, goes
whole to the rank of the stage holding the fewest bytes so far (every rank makes the same
choice: the sizes are the same everywhere), as does every 0-dim state (a step counter)
with its parameter's first rows. So with T the stage's bytes, each rank's share is at most
    T/n + the largest whole tensor (with its states) + one row of each cut tensor (with its
    states), + the stage's buffers on its first rank,
and at least T/n minus the same: `share_bound` says it in bytes.
"""
from __future__ import annotations

import torch

from meshtrain.core.memory import storage_bytes
from meshtrain.train.checkpoint_regions import Placed

WHOLE_BELOW = 64 << 10   # smaller tensors (with their states) are not worth cutting


class Share:
    """What this rank writes: model tensors by state-dict key, optimizer states by
    parameter name, and where each cut one sits in its whole tensor."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks
        self.held = [0] * ranks   # bytes each rank of the stage writes so far
        self.params: dict[str, torch.Tensor] = {}   # by parameter name
        self.model_state: dict[str, torch.Tensor] = {}   # by state-dict key, with buffers
        self.states: dict[str, dict] = {}
        self.placed: Placed = {}   # optimizer states by entry path; model tensors by key
        self.param_rows: dict[str, tuple[int, tuple[int, ...]]] = {}   # by parameter name
        self.largest_whole = self.cut_rows = 0   # for `share_bound`

    def take(self, name: str, full: torch.Tensor, full_states: dict) -> None:
        """Keep this rank's part of parameter `name` (whole) and its states."""
        tensors = [full, *(v for v in full_states.values() if param_shaped(v))]
        total = sum(t.numel() * t.element_size() for t in tensors)
        rows = full.shape[0] if full.dim() else 0
        if total < WHOLE_BELOW or rows < self.ranks:
            self._take_whole(name, full, full_states, total)
            return
        row_bytes = total // rows
        bounds = [i * rows // self.ranks for i in range(self.ranks + 1)]
        for i in range(self.ranks):
            self.held[i] += (bounds[i + 1] - bounds[i]) * row_bytes
        self.cut_rows += row_bytes
        first, last = bounds[self.rank], bounds[self.rank + 1]
        self.params[name] = _to_host(full.narrow(0, first, last - first))
        self.param_rows[name] = (first, tuple(full.shape))
        kept = {}
        for key, value in full_states.items():
            if param_shaped(value):
                kept[key] = _to_host(value.narrow(0, first, last - first))
                self.placed[("optim", "state", name, key)] = (first, tuple(value.shape))
            elif self.rank == 0:   # a step counter: with the first rows
                kept[key] = value
        if kept:
            self.states[name] = kept

    def _take_whole(self, name: str, full: torch.Tensor, full_states: dict, total: int) -> None:
        keeper = self.held.index(min(self.held))
        self.held[keeper] += total
        self.largest_whole = max(self.largest_whole, total)
        if keeper == self.rank:
            self.params[name] = _to_host(full)
            if full_states:
                self.states[name] = {k: _to_host(v) if isinstance(v, torch.Tensor) else v
                                     for k, v in full_states.items()}

    def bytes(self) -> int:
        """Bytes of the tensors this rank writes."""
        return storage_bytes([*self.model_state.values(),
                              *(v for s in self.states.values() for v in s.values())])

    def bound(self) -> int:
        """How far from the stage's bytes / n a share may be, buffers aside."""
        return self.largest_whole + self.cut_rows


def share_of_state(trainer) -> Share:
    """This rank's share of `trainer`'s consolidated state ([Note: even shares]), with its
    model tensors by state-dict key (`model_state`) and where each cut one sits by entry
    path (`placed`). Collective: every rank of the stage consolidates the same groups.
    Tied tensors and buffers appear on every stage that holds them."""
    mesh, sharding = trainer.mesh, trainer.sharding
    replicas = mesh.replica_axis   # every rank of a stage keeps a share
    share = Share(mesh.axis_rank(replicas) * mesh.size("tp") + mesh.axis_rank("tp"),
                  mesh.size(replicas) * mesh.size("tp"))
    for local, local_states in trainer.data_parallel.local_state_groups():
        for name, value in local.items():
            full = sharding.full(name, value)   # collective over tp
            full_states = {k: sharding.full(name, v) if param_shaped(v) else v
                           for k, v in local_states.get(name, {}).items()}
            share.take(name, full, full_states)
            del full, full_states   # the group's whole tensors go with the group
    params = dict(share.params)
    if share.rank == 0:
        params.update({n: b.detach() for n, b in trainer.stages.named_buffers()})
    for key, name in trainer.layout.canonical.items():
        if name in params:
            share.model_state[key] = params[name]
            if name in share.param_rows:
                share.placed[("model", key)] = share.param_rows[name]
    return share


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: a kept part outlives its group, and holds no device memory."""
    return t.to("cpu", copy=True)


def param_shaped(value) -> bool:
    """An optimizer state that has one element per parameter element (not a 0-dim count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
