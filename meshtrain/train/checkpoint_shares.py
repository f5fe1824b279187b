"""Each rank's share of the consolidated state a checkpoint writes (`Trainer.save`).

[Note: even shares]
The n ranks of a pipeline stage (its replicas x tp) write its state between them, each its
rows (dim 0) of each parameter and of each per-element state of it, copied to host memory
as each group is taken; DCP records each part at its offsets in the whole tensor (`placed`:
the boxes, as it records a sharded DTensor's chunks), so the checkpoint stays the whole,
plan-independent state. A tensor whole over tp is cut into n ranges of rows (rank i:
[i*R//n, (i+1)*R//n)); a tp slice (`LayerSharding.region`: a column or row slice, one box
per fused part) into one range per replica, each tp rank writing its own slice's. Under
expert parallelism ep rank k holds experts [k*E/ep, (k+1)*E/ep) of a packed expert tensor
(its region: a box of the whole), as does every rank of its edp group, with their tp (and
cp) ranks: those cut it between them, a range of its rows (experts) each, so every ep rank
writes its own experts and nothing is gathered over ep (`Share._positions`). The rows come
- straight from the sync's shards where it offers them (`GradientSync.state_rows`: ZeRO
  moves each rank its ranges of a bucket in one all-to-all, no rank holding a whole bucket
  or tensor; an expert bucket over its edp group);
- else from a group consolidated at a time (`local_state_groups`: DDP and the other syncs
  hold theirs whole along dp already), cut where it lies.
A tensor whose bytes with its states are under `WHOLE_BELOW`, or with fewer rows than the
ranks cutting it, goes whole to the rank (a tp slice: the replica; an expert part: one rank
of each ep rank's holders) holding the fewest bytes so far (every rank makes the same
choice: the sizes are the same everywhere); a 0-dim state
(a step counter) goes with the whole tensor's first element. So, with T the stage's bytes,
every rank's share is within
    the largest whole part (with its states) + one row of each cut one (with its states)
of T/n (`Share.bound`), the stage's buffers (on its first rank) and step counters aside.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from meshtrain.core.memory import storage_bytes
from meshtrain.core.regions import Region, narrow_rows, whole
from meshtrain.train.checkpoint_regions import Placed

WHOLE_BELOW = 64 << 10   # smaller tensors (with their states) are not worth cutting
WholeOf = Callable[[str], tuple[tuple[int, ...], Region]]   # name -> (whole shape, region)


class Share:
    """What this rank writes: model tensors by state-dict key, optimizer states by
    parameter name, and where each cut one sits in its whole tensor. This rank is (q, t)
    of the stage: replica q, tp rank t."""

    def __init__(self, q: int, replicas: int, t: int, tp: int, region_of: WholeOf,
                 experts: frozenset = frozenset(), ep: int = 1, cp: int = 1) -> None:
        """`region_of(name)`: the whole tensor's shape, and the boxes of it this rank's
        tensor `name` (as the sync holds it) is made of; `experts`: the tensors split over
        the `ep` ranks of each dp group (q = dp rank * cp + cp rank)."""
        self.q, self.replicas, self.t, self.tp = q, replicas, t, tp
        self.rank, self.ranks, self.region_of = q * tp + t, replicas * tp, region_of
        self.experts, self.ep, self.cp = experts, ep, cp
        self.held = [0] * self.ranks   # bytes each rank of the stage writes so far
        self.params: dict[str, torch.Tensor] = {}   # by parameter name
        self.model_state: dict[str, torch.Tensor] = {}   # by state-dict key, with buffers
        self.states: dict[str, dict] = {}
        self.placed: Placed = {}   # by entry path: (whole shape, boxes)
        self.param_places: dict[str, tuple] = {}   # the placed parameters', by name
        # by name: (rows kept, the first row given, the boxes of the whole they fill)
        self.rows: dict[str, tuple[tuple[int, int], int, tuple]] = {}
        self.largest_whole = self.cut_rows = 0   # for `bound`

    def _positions(self, name: str, split: bool) -> tuple[list[int], int]:
        """Each stage rank's position among the ranks holding the same part of `name`
        (they cut it between them, a range of rows each), and how many positions one of
        the sync's replicas of `name` covers: whole over tp, each rank its own (a replica,
        its tp ranks'); a tp slice, its replica's (each tp rank of it its own slice's); an
        expert tensor under ep, its place among the ranks holding the same experts (its
        edp group's, with their cp and tp ranks; the sync's replica: its edp rank)."""
        if name in self.experts:
            def position(r: int) -> int:
                dp_rank, c = divmod(r // self.tp, self.cp)
                return ((dp_rank // self.ep) * self.cp + c) * self.tp + r % self.tp
            return [position(r) for r in range(self.ranks)], self.cp * self.tp
        if split:
            return [r // self.tp for r in range(self.ranks)], 1
        return list(range(self.ranks)), self.tp

    def assign(self, name: str, shape: tuple[int, ...], element_bytes: int
               ) -> list[tuple[int, int]]:
        """Which rows (first, last) of parameter `name` and of its per-element states
        (`element_bytes` an element, all of them; `shape` as the sync holds it) each of the
        sync's replicas of it takes: a tensor whole over tp, the rows of all its tp ranks."""
        total, rows = math.prod(shape) * element_bytes, shape[0] if shape else 0
        whole_shape, region = self.region_of(name)
        position, per_replica = self._positions(name, region != whole(whole_shape))
        n, mine = max(position) + 1, position[self.rank]   # n ranks cut each part
        if total < WHOLE_BELOW or rows < n:
            self.largest_whole = max(self.largest_whole, total)
            load = [0] * n
            for r, p in enumerate(position):
                load[p] += self.held[r]
            keeper = load.index(min(load))   # one rank of each part writes it whole
            for r, p in enumerate(position):
                self.held[r] += total if p == keeper else 0
            if mine == keeper:
                self._mine(name, shape, (0, rows or 1), 0)
            return [(0, rows or 1) if q == keeper // per_replica else (0, 0)
                    for q in range(n // per_replica)]
        self.cut_rows += total // rows
        bounds = [i * rows // n for i in range(n + 1)]
        for r, p in enumerate(position):
            self.held[r] += (bounds[p + 1] - bounds[p]) * (total // rows)
        given = [(bounds[q * per_replica], bounds[(q + 1) * per_replica])
                 for q in range(n // per_replica)]
        self._mine(name, shape, (bounds[mine], bounds[mine + 1]),
                   given[mine // per_replica][0])
        return given

    def _mine(self, name: str, shape: tuple[int, ...], rows: tuple[int, int], given: int
              ) -> None:
        """This rank keeps `rows` of `name` (of `shape`), given from row `given` on."""
        whole_shape, region = self.region_of(name)
        boxes = ()
        if shape and (region != whole(whole_shape) or rows[1] - rows[0] < whole_shape[0]):
            row = math.prod(shape[1:])   # not the whole tensor: where its part sits
            boxes = tuple(region.within((rows[0] * row, rows[1] * row)).reads())
        self.rows[name] = (rows, given, boxes)

    def keep(self, name: str, part: torch.Tensor | None, states: dict,
             at: int | None = None) -> None:
        """Of the rows of parameter `name` `assign` gave this rank's replica (`part`, and
        `states` of it; either may come alone; `at`: they begin at that row of the tensor
        instead), this rank's, copied to host memory with where they sit."""
        if name not in self.rows:
            return
        (first, last), given, boxes = self.rows[name]
        given = given if at is None else at
        shape = self.region_of(name)[0]

        def cut(t: torch.Tensor) -> torch.Tensor:
            return _to_host(narrow_rows(t, (first - given, last - given)))
        if part is not None:
            self.params[name] = cut(part)
            if boxes:
                self.param_places[name] = (shape, boxes)
        # a 0-dim state (a step counter) with the whole tensor's first element
        first_element = not boxes or any(not any(b.offsets) for b in boxes)
        kept = {k: cut(v) if param_shaped(v) else v
                for k, v in states.items() if param_shaped(v) or first_element}
        if kept:
            self.states.setdefault(name, {}).update(kept)
        if boxes:
            self.placed.update({("optim", "state", name, k): (shape, boxes)
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
    model tensors by state-dict key (`model_state`) and where each placed one sits by
    entry path (`placed`). Collective: every rank of the stage takes the same groups. Tied
    tensors and buffers appear on every stage that holds them."""
    mesh, sync, sharding = trainer.mesh, trainer.data_parallel, trainer.sharding
    shapes, replicas = trainer.layout.shapes, mesh.replica_axis   # every rank keeps a share
    share = Share(mesh.axis_rank(replicas), mesh.size(replicas), mesh.axis_rank("tp"),
                  mesh.size("tp"), lambda name: (shapes[name],
                                                 sharding.region(name, shapes[name])),
                  frozenset(sharding.replicas), trainer.plan.ep, mesh.size("cp"))
    rows = sync.state_rows(share.assign)
    if rows is None:
        _keep_groups(trainer, share)
    for params, states in rows or ():   # parameters and their states may come apart
        for name in {*params, *states}:
            share.keep(name, params.get(name), states.get(name, {}))
        del params, states   # these rows go before the next are taken
    params = dict(share.params)
    if share.rank == 0:
        params.update({n: b.detach() for n, b in trainer.stages.named_buffers()})
    for key, name in trainer.layout.canonical.items():
        if name in params:
            share.model_state[key] = params[name]
            if name in share.param_places:
                share.placed[("model", key)] = share.param_places[name]
    return share


def _keep_groups(trainer, share: Share) -> None:
    """Each group consolidated (`local_state_groups`), each tensor of it cut to this rank's
    rows; the group goes before the next."""
    for local, local_states in trainer.data_parallel.local_state_groups():
        for name, value in local.items():
            states = local_states.get(name, {})
            element_bytes = value.element_size() + sum(
                v.element_size() for v in states.values() if param_shaped(v))
            share.assign(name, tuple(value.shape), element_bytes)
            share.keep(name, value, states, at=0)
        del local, local_states


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: a kept part outlives its group, and holds no device memory."""
    return t.to("cpu", copy=True)


def param_shaped(value) -> bool:
    """An optimizer state that has one element per parameter element (not a 0-dim count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
