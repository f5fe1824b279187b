"""DDP: one process per device, bucketed all-reduce overlapped with backward, no master.

Every data-parallel rank holds the whole model. At start, parameters are broadcast from dp
rank 0 so that all replicas begin identical. During backward, a hook on each parameter moves
its gradient, divided by the dp size, into its bucket and marks it ready; the moment a
bucket's last gradient is ready its all-reduce (a sum: the average, pre-divided) is launched
asynchronously, so communication overlaps the rest of backward. `finish_gradient_sync`
launches what is left, waits, and makes each .grad a view of its averaged slot.

[Note: the last bucket]
The last bucket holds the first layers, whose gradients backward produces last: it could
only ever be launched as backward ends. So `finish_gradient_sync` launches it, and it
carries the step's statistics (the loss, which parameters were used) as an extra payload:
one collective per step fewer. Its parameters keep their hooks all the same: moving each
gradient into the bucket the moment it exists keeps one copy of the gradients in memory,
not two (measured: leaving them to the end cost 4 bytes per parameter of peak memory).

The hooks, buckets and launch order are shared with ZeRO (gradient_buckets.py).

[Note: bf16]
With Plan(precision="bf16") parameters and buckets are bf16; a bucket is reduced as a
reduce-scatter whose sums are taken in fp32 (Comm.reduce_scatter's all-to-all), rounded once
to bf16, then all-gathered: the bytes of a bf16 all-reduce, without N-1 bf16 roundings. The
optimizer steps fp32 master weights (precision.py), laid out as the buckets are, and the
parameters too: a step's cast of the gradients to fp32 and the write-back of the updated
masters are one copy per bucket, not one per parameter.

[Note: parameters without a gradient]
A parameter unused in a step never gets a gradient; its slot is zeroed at the end. One
unused on *every* rank gets `.grad = None` before the optimizer step, so the optimizer skips
it exactly as it would in one process. Every rank learns which parameters any rank used
from the statistics that ride in the last bucket.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.optim_state import load_state_by_name, param_groups_by_name, state_by_name
from meshtrain.core.plan import DDP_FIRST_BUCKET_MB
from meshtrain.strategies.shared.buckets import Bucket, build_buckets
from meshtrain.strategies.shared.flat import parameter_groups
from meshtrain.strategies.shared.gradient_buckets import GradientBuckets
from meshtrain.strategies.shared.precision import MasterWeights, cast_to
from meshtrain.strategies.shared.replicas import (ReplicaGroup, broadcast_tensors,
                                                  replica_groups)
from meshtrain.strategies.slots import GradientSync


# torch DDP's first bucket (DDP_FIRST_BUCKET_MB): small, so that the last layers' gradients
# (backward's first) are all-reduced while backward goes on; a model whose gradients fit in
# one `bucket_mb` would otherwise overlap nothing, its one bucket being the last
# (docs/history.md). The planner prices the same buckets (planner/time_model.py).


class DDP(GradientSync):
    """Gradient synchronisation for parameters replicated along the mesh's dp axis, and the
    optimizer over them (slots 3 and 4: see strategies/slots.py, GradientSync)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, bucket_mb: float,
                 precision: str = "fp32", axis: str = "dp",
                 replicas: dict[str, ReplicaGroup] | None = None,
                 copy_when_alone: bool = False, chunks: list[nn.Module] = ()) -> None:
        """`replicas`: parameters replicated over a group smaller than the dp axis (experts
        over their edp group: strategies/expert_parallel), by name; each is broadcast and
        reduced over its own group, in buckets of its own. With one replica in fp32 autograd
        accumulates in the buckets ([Note: one replica], gradient_buckets.py), unless
        `copy_when_alone` (a subclass that works on the hooks' copies: PowerSGD). `chunks`:
        an interleaved stage's chunks, bucketed apart (see `backward_done`)."""
        self.comm, self.axis = comm, axis
        self.replicas = replicas = dict(replicas or {})
        broadcast_tensors([p for n, p in named_params if n not in replicas] + list(buffers),
                          comm, axis)
        for name, p in named_params:
            if name in replicas:
                broadcast_tensors([p], replicas[name].comm, replicas[name].axis)
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self._name_of = {id(p): n for n, p in self.named.items()}
        self.params = list(self.named.values())
        self.masters = MasterWeights(self.params, precision)   # before the cast: fp32 values
        cast_to(precision, self.params, list(buffers))
        n = comm.mesh.size(axis)
        self.mixed = precision != "fp32"
        # the last bucket's payload: this rank's loss, then one "used" flag per parameter
        # (fp32 payload; in bf16 the statistics travel in their own small all-reduce)
        dense = [p for name, p in self.named.items() if name not in replicas]
        buckets = build_buckets([], bucket_mb * 2**20,
                                last_extra=0 if self.mixed else 1 + len(self.params),
                                pad_to=n if self.mixed else 1,
                                groups=replica_groups(self.named, replicas)
                                + parameter_groups(dense, [], chunks),
                                first_bytes=min(DDP_FIRST_BUCKET_MB, bucket_mb) * 2**20)
        self._group_of = {b.index: replicas.get(self._name_of[id(b.params[0])])
                          for b in buckets}   # None: the whole dp axis
        self.lone = n == 1 and not self.mixed and not replicas and not copy_when_alone
        self.grads = GradientBuckets(self.params, buckets, self._launch, scale=1.0 / n,
                                     hold_last=not self.mixed, in_place=self.lone)
        self.buckets = buckets
        if self.mixed:   # masters laid out as the buckets: one cast and one write-back each
            self.masters.flatten([b.params for b in buckets])
        self.zero_grad()

    @property
    def events(self) -> list[tuple[str, int, float]]:
        return self.grads.events

    # ---- the step -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: no gradients yet (each lands in its bucket as backward makes it)."""
        self.grads.start_step()

    def no_sync(self):
        """Accumulate gradients locally (earlier micro-batches): no communication."""
        return self.grads.paused()

    def backward_done(self, params: list[nn.Parameter]) -> None:
        """A chunk's gradients are final: all-reduce them now (gradient_buckets.py, [Note: a
        chunk done])."""
        if not self.lone:
            self.grads.launch_done(self.grads.holding(params))

    def _launch(self, bucket: Bucket):
        group = self._group_of[bucket.index]
        comm, axis = (self.comm, self.axis) if group is None else (group.comm, group.axis)
        if comm.mesh.size(axis) == 1:   # one replica: its gradients are the mean
            return None
        if not self.mixed:
            return comm.all_reduce(bucket.buffer, axis, op="sum", tag="grad", async_op=True)
        return _ReduceThenGather(comm, bucket.buffer, axis)

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """After the last backward: launch every bucket not yet launched (the statistics
        riding in the last), wait for all; return the global mean loss."""
        if self.lone:   # the gradients are in their slots already
            for p in self.params:
                if id(p) not in self.grads.used_in_step:
                    p.grad = None
            return local_loss.float().item()   # as the statistics carry it
        stats = torch.cat([local_loss.reshape(1).float(), self.grads.used_flags()])
        if not self.mixed:
            self.buckets[-1].extra.copy_(stats)
        self.grads.flush()
        if self.mixed:
            self.comm.all_reduce(stats, self.axis, tag="step")
        self.grads.wait()
        if not self.mixed:
            stats = self.buckets[-1].extra
        loss, *users = stats.tolist()  # one host sync; users: how many ranks used each param
        for p, used_by in zip(self.params, users):
            bucket, i = self.grads.slot(p)
            p.grad = bucket.grad_view(i) if used_by else None
        return loss / self.comm.mesh.size(self.axis)

    # ---- the optimizer (slot 4) ------------------------------------------------------------
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """The user's optimizer over every parameter (their fp32 masters in bf16): DDP keeps
        whole replicas."""
        self.optimizer = factory(self.masters.masters)
        return self.optimizer

    def step(self) -> None:
        if self.mixed:
            self.masters.set_group_grads([b.buffer[:b.gradient_numel] for b in self.buckets],
                                         [p.grad is not None for p in self.params])
        elif self.masters.separate:   # else the optimizer steps the parameters, .grad set
            self.masters.set_grads([p.grad for p in self.params])
        self.optimizer.step()
        self.masters.write_back()

    # ---- after the sync: other axes, clipping ---------------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return self.named[name].grad

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        """Every replica holds every averaged gradient: rank 0 of its replicas (dp, or its
        own group) alone counts it."""
        total = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        first = self.comm.mesh.axis_rank(self.axis) == 0
        for name, p in self.named.items():
            group = self.replicas.get(name)
            if (first if group is None else group.rank == 0) and p.grad is not None \
                    and counted(name):
                total += p.grad.double().square().sum()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    # ---- state ----------------------------------------------------------------------------
    def _master_of(self) -> dict[int, str]:
        return {id(m): self._name_of[id(p)] for m, p in zip(self.masters.masters, self.params)}

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters' exact values: the fp32 masters under bf16."""
        return {self._name_of[id(p)]: m.detach()
                for m, p in zip(self.masters.masters, self.params)}

    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        names = self._master_of()
        return (state_by_name(self.optimizer, names),
                param_groups_by_name(self.optimizer, names))

    @torch.no_grad()
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        self.masters.load([params[self._name_of[id(p)]] for p in self.params])
        self.zero_grad()
        if optimizer_state is not None:
            masters = {self._name_of[id(p)]: m for m, p in zip(self.masters.masters, self.params)}
            load_state_by_name(self.optimizer, masters, *optimizer_state)

    # ---- accounting ---------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        optimizer = storage_bytes(optimizer_state_tensors(self.optimizer))
        if self.masters.separate:
            optimizer += storage_bytes(self.masters.masters)
        return {"parameters": storage_bytes(self.params), "gradients": self.gradient_bytes,
                "optimizer_states": optimizer}

    @property
    def gradient_bytes(self) -> int:
        """The buckets (with their padding, in bf16), less the statistics' payload."""
        payload = 0 if self.mixed else (1 + len(self.params)) * self.buckets[-1].dtype.itemsize
        return sum(b.nbytes for b in self.buckets) - payload

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()


class _ReduceThenGather:
    """bf16 all-reduce of a padded bucket as two halves: reduce-scatter with fp32 sums, then
    all-gather of the rounded bf16 sums (see [Note: bf16])."""

    def __init__(self, comm: Comm, buffer: torch.Tensor, axis: str) -> None:
        self.comm, self.buffer, self.axis = comm, buffer, axis
        n, r = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
        self.mine = buffer.view(n, -1)[r]
        self.summed = torch.empty_like(self.mine, dtype=torch.float32)
        self.work = comm.reduce_scatter(self.summed, buffer, axis, tag="grad", async_op=True)

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        self.mine.copy_(self.summed)   # one rounding of the fp32 sum
        self.comm.all_gather(self.buffer, self.mine.clone(), self.axis, tag="grad")
