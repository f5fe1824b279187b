"""ZeRO-3 (P_os+g+p, Rajbhandari et al. 2020): parameters sharded too, gathered just in time.

The model is cut into wrapping units (the GPT's `layers()`, or a model's direct children, or
the modules the user names). Each unit's parameters live as one flat shard of exactly 1/N per
rank (flat.py); the whole unit exists only between a gather and a free:

    forward   gather unit i (waiting for it), launch the gather of unit i+1 (prefetch), run
              unit i, free it (not the last unit: its backward follows at once)
    backward  as unit i's backward starts: gather it again, prefetch unit i-1; when its last
              gradient is in, reduce-scatter its gradients into this rank's gradient shard
              (the bucket machinery ZeRO-2 uses: a unit is a bucket) and free the unit
    step      the optimizer steps the shards; nothing to gather: the next forward does it

Parameters used by several units (a tied embedding and output layer) and parameters in no
unit form the root unit, gathered when the model's forward starts and freed when its
gradients are reduced at the end of backward. Traffic per micro-batch is two all-gathers
and one reduce-scatter of Ψ, 1.5x DDP's, less the second gather of the last unit and the
root. Memory between steps: 16Ψ/N bytes for fp32 AdamW (Ψ padded); during a step, on top,
the root and at most two units (the one computing and the one prefetched).

[Note: one storage per unit]
Autograd keeps what forward saved, and forward saves views of the parameters (a linear
layer's transposed weight): views of the storage the unit was gathered into. Had each gather
made a new tensor, a unit freed after its forward would have stayed in memory through its
saved views until its backward: every unit at once at the start of backward (measured on
the 4-block verification GPT: 15 MB above the prediction's two units, +14%). So a unit owns
one storage for its life, resized to nothing when freed and back to the unit's size when
gathered (as PyTorch's FSDP does): the saved views hold no memory between, and see the
gathered values again in backward.

[Note: ZeRO-3 under pipeline stages]
A schedule interleaves a stage's micro-batches (1F1B runs forward k+1 before backward k), so
backward no longer follows forward at once. The default policy is torchtitan's FSDP2 under pp
(`reshard_after_forward=False`, gradient sync on the last micro-batch only): each of the
stage's units is gathered when its first forward needs it and kept until the stage's last
backward; gradients accumulate whole in the unit's bucket (a round is the step, as ZeRO-1's)
and are reduce-scattered once, the unit freed as its bucket is launched. Per step and rank:
one all-gather and one reduce-scatter of the stage's Psi_s (DDP's bytes, whatever M); at
rest 16 Psi_s / N (fp32 AdamW); during a step, on top, the stage's whole parameters and
gradients (8 Psi_s in fp32). The hooks sit on each chunk this rank runs (a pipeline never
calls the model); weights tied across stages are a root bucket of their own, laid out alike
on every holder.
`Plan.zero3_regather` trades bytes for that memory (FSDP2's `reshard_after_forward=True`
with gradient sync left on every micro-batch; torch's pipelining stage turns the sync and
the reshard after backward off for all but the last backward, so it keeps the stage's
gradients whole either way): each micro-batch gathers every unit for its forward
and frees it after (the stage's last unit too: another micro-batch may run before its
backward), gathers it again for its backward, and reduce-scatters its gradients into the
shard as ZeRO-2 does (a round is a backward); the root is freed as the chunk's forward
ends and gathered again as its backward starts. Per step and rank: 2M all-gathers and M
reduce-scatters of every unit; during a step, on top of the shards, the root and at most
two units gathered (the one computing, the next prefetched) and at most three units'
gradients (one filling, two reduce-scattering), as ZeRO-3 at pp = 1 already does. Under
interleaved stages a unit prefetches the next one of its own chunk only (the rank's next
chunk may not run next), and a backward reduce-scatters only its chunk's units (the runtime
names the chunk: gradient_buckets.py, [Note: a round's reach]). Not built for zero bubble,
whose weight pass would need its units gathered a third time.

Parameter storage follows a state machine named by what is in memory (`Held`): SHARDED (the
shard alone; the parameters point at empty tensors), GATHERING (an all-gather in flight into
a whole buffer), GATHERED (the parameters are views into it). Under fp8's tensorwise scaling
a unit's float8 linears' weights are a part of their own, gathered as e4m3 (float8_gather.py).
"""
from __future__ import annotations

import enum
import time

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from meshtrain.core.comm import Comm
from meshtrain.core.memory import storage_bytes
from meshtrain.core.plan import Plan
from meshtrain.strategies.shared.buckets import Bucket, build_buckets
from meshtrain.strategies.shared.precision import MasterWeights
from meshtrain.strategies.zero.float8_gather import (Float8Part, Float8Scales, float8_part,
                                                     float8_weights, split_float8)
from meshtrain.strategies.zero.sharded import ZeRO
from meshtrain.strategies.zero.units import check_units_run, output_tensors, wrapping_units


class Held(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """One wrapping unit's parameters: always its flat shard, the whole buffer only while
    gathered."""

    def __init__(self, name: str, bucket: Bucket, shard: torch.Tensor, comm: Comm, axis: str,
                 owner: "ZeRO3", float8: Float8Part | None = None) -> None:
        """`float8`: a bucket of float8 linears' weights, gathered as e4m3 bytes."""
        self.name, self.bucket, self.shard = name, bucket, shard
        self.comm, self.axis, self.owner, self.float8 = comm, axis, owner, float8
        self.wire = torch.uint8 if float8 is not None else shard.dtype
        self.held = Held.SHARDED
        self.whole: torch.Tensor | None = None
        self.handle = None
        self._point_at(None)

    @property
    def nbytes(self) -> int:
        return self.bucket.numel * self.wire.itemsize

    def gather(self) -> None:
        """Launch the all-gather of the whole unit (nothing if it is gathered or on its way)."""
        if self.held is not Held.SHARDED:
            return
        device = self.comm.mesh.device   # the compute device, wherever offload keeps shards
        if self.whole is None:
            self.whole = torch.empty(self.bucket.numel, dtype=self.wire, device=device)
        else:   # see [Note: one storage per unit]
            self.whole.untyped_storage().resize_(self.nbytes)
        shard = self.shard.to(device, non_blocking=self.shard.is_pinned())
        if self.float8 is not None:
            shard = self.float8.cast(shard)
        self.handle = self.comm.all_gather(self.whole, shard, self.axis, tag="param",
                                           async_op=True)
        self.held = Held.GATHERING
        self.owner.gathered_changed(+self.nbytes)
        self.owner.log("gather", self)

    def wait(self) -> None:
        """Make the parameters views into the whole unit, gathering first if needed."""
        self.gather()
        if self.held is Held.GATHERING:
            self.handle.wait()
            self.handle = None
            self._point_at(self.whole)
            self.held = Held.GATHERED

    def free(self) -> None:
        if self.held is Held.SHARDED:
            return
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self._point_at(None)
        self.whole.untyped_storage().resize_(0)   # see [Note: one storage per unit]
        self.held = Held.SHARDED
        self.owner.gathered_changed(-self.nbytes)

    def _point_at(self, whole: torch.Tensor | None) -> None:
        if self.float8 is not None:
            self.float8.point_at(whole)
            return
        for offset, shape, p in zip(self.bucket.offsets, self.bucket.shapes, self.bucket.params):
            p.data = (whole[offset:offset + shape.numel()].view(shape) if whole is not None
                      else torch.empty(0, dtype=self.shard.dtype, device=self.comm.mesh.device))


class Parts:
    """A wrapping unit as one Unit per group its parameters are sharded over: dp, and for
    experts under expert parallel their edp group (strategies/shared/replicas.py)."""

    def __init__(self, units: list[Unit]) -> None:
        self.units, self.name = units, units[0].name

    def gather(self) -> None:
        for unit in self.units:
            unit.gather()

    def wait(self) -> None:
        self.gather()   # every part's gather in flight before waiting for the first
        for unit in self.units:
            unit.wait()

    def free(self) -> None:
        for unit in self.units:
            unit.free()


class ZeRO3(ZeRO):
    """Slots 3 and 4 for Plan(zero=3): ZeRO-2's sharded gradients and optimizer, and
    parameters gathered unit by unit around their use."""

    forward_gathers = True

    def __init__(self, model: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, plan: Plan,
                 unit_names: list[str] | None = None, axis: str = "dp",
                 offload_dir=None, fill=None, replicas=None,
                 entries: list[nn.Module] | None = None, shared: list[str] = ()) -> None:
        """`entries`: the modules a step calls (the model, or this rank's pipeline chunks);
        `shared`: parameters several pipeline stages hold (a bucket of their own, laid out
        alike on each). Under pp > 1 see [Note: ZeRO-3 under pipeline stages]."""
        self._unit_modules = wrapping_units(model, unit_names)
        # under stages: kept from the first forward to the last backward (torchtitan's
        # policy), or, zero3_regather, gathered for each micro-batch's forward and backward
        self.regather = plan.pp > 1 and plan.zero3_regather
        self.keep_gathered = plan.pp > 1 and not self.regather
        check_units_run(self._unit_modules, entries or [model], named_params)
        self._float8 = float8_weights(model, plan)   # id -> linear: gathered in e4m3
        self.float8_scales = Float8Scales(comm, axis)
        self._fill = fill   # a model on the meta device: its values stream into the shards
        self._frozen = {n: p for n, p in named_params if not p.requires_grad}
        self.gathered_bytes = self.gathered_peak = 0
        self.unit_events: list[tuple[str, str, float]] = []   # (what, unit, time): prefetch log
        super().__init__(named_params, buffers, comm, plan, shared=shared, axis=axis,
                         offload_dir=offload_dir, replicas=replicas)
        self._hook(entries or [model])

    def _reduces_each_microbatch(self, plan: Plan) -> bool:
        # under stages: once per step unless regathered, see [Note: ZeRO-3 under pipeline stages]
        return plan.pp == 1 or plan.zero3_regather

    # ---- layout: one bucket per unit, the root last ---------------------------------------------
    def _make_buckets(self, plan: Plan, compute: torch.dtype, shared) -> list[Bucket]:
        owners: dict[int, list[int]] = {}
        for i, (_, module) in enumerate(self._unit_modules):
            for p in module.parameters():
                owners.setdefault(id(p), []).append(i)
        in_unit = [[p for p in self.params if owners.get(id(p)) == [i]]
                   for i in range(len(self._unit_modules))]
        root = [p for p in self.params if len(owners.get(id(p), [])) != 1]
        tied = {id(self.named[n]) for n in shared if n in self.named}
        # backward order: the last unit's gradients come first; the root's at the very end,
        # weights tied across stages in a bucket of their own (laid out alike on each holder)
        roots = [[p for p in root if id(p) not in tied], [p for p in root if id(p) in tied]]
        order = [(i, in_unit[i]) for i in reversed(range(len(in_unit))) if in_unit[i]] + [
            (None, r) for r in roots if r]
        groups, self._unit_of_bucket = [], []
        for i, params in order:   # a bucket per group a unit's parameters are sharded over
            for part in self._split_by_replicas(params):
                groups.append(part)
                self._unit_of_bucket.append(i)
        buckets = build_buckets([], float("inf"), pad_to=self.n, dtype=compute, lazy=True,
                                groups=groups)
        for b in buckets:   # the compute device, also for parameters still on the meta device
            b.device = self.comm.mesh.device
        return buckets

    def _split_by_replicas(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` of one unit: those sharded over dp, then each replica group's."""
        name = {id(p): n for n, p in self.named.items()}
        parts: dict = {}
        for p in params:
            parts.setdefault(self.replicas.get(name[id(p)]), []).append(p)
        dense = parts.pop(None, None)
        return (split_float8(dense, self._float8) if dense else []) + list(parts.values())

    def _make_storage(self, precision: str, compute: torch.dtype) -> MasterWeights:
        """Only this rank's shard of each unit; the optimizer steps it (its fp32 master)."""
        master_dtype = torch.float32 if precision != "fp32" else compute
        fp32 = [torch.zeros(self.layout.shard_size(b.index), dtype=master_dtype,
                            device=self.comm.mesh.device) for b in self.buckets]
        if self._fill is not None:
            self._fill(lambda name, whole: self._take(fp32, name, whole))
            for p in self.params:   # real from now on: Unit points them at its buffer
                if p.is_meta:
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(
                        0, dtype=p.dtype, device=self.comm.mesh.device)))
        else:
            for name, p in self.named.items():
                self._take(fp32, name, p.detach())
        # between uses, a unit's shard lives where offload keeps things (a file for "disk")
        self.shards = [self.offload.place(s.to(compute).clone()) for s in fp32]
        self.units = [Unit(self._unit_name(b), b, shard, *self._where(b.index), self,
                           float8_part(b, shard, self.layout, self._float8, self.float8_scales))
                      for b, shard in zip(self.buckets, self.shards)]
        parts: dict[int | None, list[Unit]] = {}
        for unit, i in zip(self.units, self._unit_of_bucket):
            parts.setdefault(i, []).append(unit)
        self._by_module_index = {i: Parts(us) for i, us in parts.items() if i is not None}
        self.root = Parts(parts[None]) if None in parts else None
        return self._masters(self.shards, precision, fp32)

    def _take(self, shards: list[torch.Tensor], name: str, whole: torch.Tensor) -> None:
        """Copy this rank's part of parameter `name` (whole) into its shard: no rank ever
        joins the whole model."""
        piece = self.layout.by_name.get(name)
        if piece is None:   # frozen: kept whole, as without ZeRO-3
            frozen = self._frozen[name]
            torch.utils.swap_tensors(frozen, nn.Parameter(
                whole.to(self.comm.mesh.device, frozen.dtype, copy=True), requires_grad=False))
            return
        lo, hi = self.layout.owned(piece)
        if hi > lo:
            rank = self.layout.split_of(piece.bucket)[1]
            start = rank * self.layout.shard_size(piece.bucket) + lo - piece.start
            shards[piece.bucket][lo:hi] = whole.reshape(-1)[start:start + hi - lo]

    def _unit_name(self, bucket: Bucket) -> str:
        i = self._unit_of_bucket[bucket.index]
        return "root" if i is None else self._unit_modules[i][0]

    # ---- the hooks that gather and free -----------------------------------------------------------
    def _hook(self, entries: list[nn.Module]) -> None:
        self._chunk_of: dict[int, int] = {}   # unit index -> the entry (chunk) running it
        for c, entry in enumerate(entries):   # the model, or each pipeline chunk this rank runs
            inside = {id(m) for m in entry.modules()}
            self._chunk_of.update({i: c for i, (_, m) in enumerate(self._unit_modules)
                                   if id(m) in inside})
            first = next((i for i, (_, m) in enumerate(self._unit_modules)
                          if id(m) in inside and i in self._by_module_index), None)
            entry.register_forward_pre_hook(lambda m, args, i=first: self._model_starts(i))
            entry.register_forward_hook(lambda m, args, out: self._model_ends(out))
        self._last = max(self._by_module_index, default=None)
        for i, (_, module) in enumerate(self._unit_modules):
            if i in self._by_module_index:
                module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
                module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    def _neighbour(self, i: int, step: int) -> Unit | None:
        """The next unit with parameters after unit i in its chunk, going forward (+1) or
        backward (-1): an interleaved stage's next chunk may not run next."""
        j = i + step
        while 0 <= j < len(self._unit_modules) and self._chunk_of.get(j) == self._chunk_of[i]:
            if j in self._by_module_index:
                return self._by_module_index[j]
            j += step
        return None

    def _model_starts(self, first: int | None) -> None:
        if first is not None:
            self._by_module_index[first].gather()   # its all-gather overlaps the root's
        if self.root is not None:
            self.root.wait()

    def _model_ends(self, output) -> None:
        if not torch.is_grad_enabled():   # no backward follows (evaluation): free everything
            for unit in self.units:
                unit.free()
        elif self.regather and self.root is not None:   # other micro-batches run before
            self.root.free()                             # this one's backward: gather it then
            tensors = [t for t in output_tensors(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads: self.root.wait(), mode="any")

    def _before_forward(self, i: int) -> None:
        unit = self._by_module_index[i]
        unit.wait()
        following = self._neighbour(i, +1)
        if following is not None:
            following.gather()   # prefetch: its all-gather overlaps this unit's compute
        self.log("compute", unit)

    def _after_forward(self, i: int, output) -> None:
        unit = self._by_module_index[i]
        self.log("computed", unit)
        if not torch.is_grad_enabled():
            unit.free()
            return
        if (i != self._last or self.regather) and not self.keep_gathered:
            unit.free()
        tensors = [t for t in output_tensors(output) if t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads, i=i: self._before_backward(i),
                                     mode="any")

    def _before_backward(self, i: int) -> None:
        unit = self._by_module_index[i]
        unit.wait()
        previous = self._neighbour(i, -1)
        if previous is not None:
            previous.gather()

    def _launch(self, bucket: Bucket):
        """A unit's gradients are all in: reduce-scatter them, and free the unit."""
        handle = super()._launch(bucket)
        self.units[bucket.index].free()
        return handle

    def _gather_updated(self) -> None:
        # the next forward gathers each unit as it needs it, in float8 with new scales
        self.float8_scales.changed()

    def load_local(self, params, optimizer_state) -> None:
        super().load_local(params, optimizer_state)
        self.float8_scales.changed()

    # ---- accounting -----------------------------------------------------------------------------
    def gathered_changed(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def log(self, what: str, unit: Unit) -> None:
        self.unit_events.append((what, unit.name, time.perf_counter()))

    def zero_grad(self) -> None:
        super().zero_grad()
        self.unit_events.clear()

    def parameter_bytes(self) -> int:
        """The shards in memory, and whatever is gathered right now."""
        return storage_bytes(self.shards) - self.offload.offloaded_bytes(self.shards) + self.gathered_bytes

    def _placed_tensors(self) -> list[torch.Tensor]:
        # the shards between uses too (in bf16 the masters are fp32 copies of them)
        return super()._placed_tensors() + self.shards

    def memory(self) -> dict[str, int]:
        out = super().memory()
        out["offloaded"] += self.offload.offloaded_bytes(self.shards)
        return {**out, "gathered_peak": self.gathered_peak}
