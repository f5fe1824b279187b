"""Each rank's share of the consolidated state a checkpoint writes (`Trainer.save`).

[Note: even shares]
The n ranks of a pipeline stage (its replicas x tp) write its state between them: of each
parameter and each per-element state of it, rank i keeps rows [i*R//n, (i+1)*R//n) of dim 0
(R rows), copied to host memory as each group is taken, and DCP records each range at its
offset in the whole tensor (`placed`, as it records a sharded DTensor's chunks): the
checkpoint stays the whole, plan-independent state. The rows come
- straight from the sync's shards where no layer is cut (`GradientSync.state_rows`: ZeRO
  moves each rank its ranges of a bucket in one all-to-all, no rank holding a whole
  bucket, nor a whole tensor);
- else from a group consolidated at a time (`local_state_groups`: ZeRO a bucket, ZeRO-3 a
  unit; DDP and the other syncs hold theirs whole already, nothing gathered), each tensor
  gathered whole over tp, cut and dropped before the next, the group before the next.
A parameter whose bytes with its states are under `WHOLE_BELOW`, or with fewer rows than
ranks, goes whole to the rank holding the fewest bytes so far (every rank makes the same
choice: the sizes are the same everywhere); a 0-dim state (a step counter) goes with its
parameter's first rows. So, with T the stage's bytes, every rank's share is within
    the largest whole parameter (with its states) + one row of each cut one (with its states)
of T/n (`Share.bound`), the stage's buffers (on its first rank) and step counters aside.
"""
from __future__ import annotations

import math

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
        self.placed: Placed = {}   # by entry path: (first row, whole shape)
        self.param_rows: dict[str, tuple[int, tuple[int, ...]]] = {}   # the cut ones', by name
        self.largest_whole = self.cut_rows = 0   # for `bound`

    def assign(self, name: str, shape: tuple[int, ...], element_bytes: int
               ) -> list[tuple[int, int]]:
        """Every rank's rows (first, last) of parameter `name` and its per-element states
        (`element_bytes` an element, all of them): a range each, or the whole to one."""
        total, rows = math.prod(shape) * element_bytes, shape[0] if shape else 0
        if total < WHOLE_BELOW or rows < self.ranks:
            keeper = self.held.index(min(self.held))
            self.held[keeper] += total
            self.largest_whole = max(self.largest_whole, total)
            return [(0, rows or 1) if i == keeper else (0, 0) for i in range(self.ranks)]
        bounds = [i * rows // self.ranks for i in range(self.ranks + 1)]
        for i in range(self.ranks):
            self.held[i] += (bounds[i + 1] - bounds[i]) * (total // rows)
        self.cut_rows += total // rows
        self.param_rows[name] = (bounds[self.rank], tuple(shape))
        return list(zip(bounds[:-1], bounds[1:]))

    def keep(self, name: str, part: torch.Tensor, states: dict) -> None:
        """This rank's rows of parameter `name` (as `assign` gave them) and of its states,
        copied to host memory; a 0-dim state (a step counter) with the first rows."""
        first, shape = self.param_rows.get(name, (0, None))
        self.params[name] = _to_host(part)
        kept = {k: _to_host(v) if param_shaped(v) else v
                for k, v in states.items() if param_shaped(v) or first == 0}
        if kept:
            self.states[name] = kept
        if shape is not None:
            self.placed.update({("optim", "state", name, k): (first, shape)
                                for k, v in states.items() if param_shaped(v)})

    def bytes(self) -> int:
        """Bytes of the tensors this rank writes."""
        return storage_bytes([*self.model_state.values(),
                              *(v for s in self.states.values() for v in s.values())])

    def bound(self) -> int:
        """How far from the stage's bytes / n a share may be ([Note: even shares])."""
        return self.largest_whole + self.cut_rows


def share_of_state(trainer) -> Share:
    """This rank's share of `trainer`'s consolidated state ([Note: even shares]), with its
    model tensors by state-dict key (`model_state`) and where each cut one sits by entry
    path (`placed`). Collective: every rank of the stage takes the same groups. Tied
    tensors and buffers appear on every stage that holds them."""
    mesh, sync = trainer.mesh, trainer.data_parallel
    replicas = mesh.replica_axis   # every rank of a stage keeps a share
    share = Share(mesh.axis_rank(replicas) * mesh.size("tp") + mesh.axis_rank("tp"),
                  mesh.size(replicas) * mesh.size("tp"))
    # the sync's own rows where no layer is cut: its ranks are then the stage's
    rows = sync.state_rows(share.assign) if trainer.plan.tp == trainer.plan.ep == 1 else None
    if rows is None:
        _keep_cut_groups(trainer, share)
    for params, states in rows or ():
        for name, part in params.items():
            share.keep(name, part, states.get(name, {}))
        del params, states   # the bucket's rows go before the next are taken
    params = dict(share.params)
    if share.rank == 0:
        params.update({n: b.detach() for n, b in trainer.stages.named_buffers()})
    for key, name in trainer.layout.canonical.items():
        if name in params:
            share.model_state[key] = params[name]
            if name in share.param_rows:
                share.placed[("model", key)] = share.param_rows[name]
    return share


def _keep_cut_groups(trainer, share: Share) -> None:
    """Each group consolidated (`local_state_groups`), each tensor of it gathered whole
    over tp and cut to this rank's rows, one at a time; the group goes before the next."""
    sharding = trainer.sharding
    for local, local_states in trainer.data_parallel.local_state_groups():
        for name, value in local.items():
            full = sharding.full(name, value)   # collective over tp
            full_states = {k: sharding.full(name, v) if param_shaped(v) else v
                           for k, v in local_states.get(name, {}).items()}
            element_bytes = full.element_size() + sum(
                v.element_size() for v in full_states.values() if param_shaped(v))
            first, last = share.assign(name, tuple(full.shape), element_bytes)[share.rank]
            if last > first:
                share.keep(name, _rows(full, first, last),
                           {k: _rows(v, first, last) if param_shaped(v) else v
                            for k, v in full_states.items()})
            del full, full_states   # before the next tensor is gathered
        del local, local_states


def _rows(t: torch.Tensor, first: int, last: int) -> torch.Tensor:
    return t if t.dim() == 0 else t.narrow(0, first, last - first)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: a kept part outlives its group, and holds no device memory."""
    return t.to("cpu", copy=True)


def param_shaped(value) -> bool:
    """An optimizer state that has one element per parameter element (not a 0-dim count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
