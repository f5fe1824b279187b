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

[Note: launch order]
c10d requires every rank to issue collectives in the same order, but hooks can fire in a
slightly different order from bucket order. Buckets are therefore launched strictly in index
order: a ready bucket waits until every bucket before it has been launched.

[Note: parameters without a gradient]
A parameter unused in a step never gets a gradient; its slot is zeroed at the end. One
unused on *every* rank gets `.grad = None` before the optimizer step, so the optimizer skips
it exactly as it would in one process. Every rank learns which parameters any rank used
from the statistics that ride in the last bucket.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.strategies.data_parallel.buckets import Bucket, build_buckets
from meshtrain.core.optim_state import load_state_by_name, param_groups_by_name, state_by_name


def broadcast_tensors(tensors, comm: Comm, axis: str = "dp") -> None:
    """Make every replica along `axis` equal to axis rank 0's."""
    for tensor in tensors:
        comm.broadcast(tensor.data, src=0, axis=axis, tag="init")


class DDP:
    """Gradient synchronisation for parameters replicated along the mesh's dp axis, and the
    optimizer over them (slots 3 and 4: see strategies/slots.py, GradientSync)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, bucket_mb: float,
                 axis: str = "dp") -> None:
        self.comm, self.axis = comm, axis
        broadcast_tensors([p for _, p in named_params] + list(buffers), comm, axis)
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self._name_of = {id(p): n for n, p in self.named.items()}
        self.params = list(self.named.values())
        # the last bucket's payload: this rank's loss, then one "used" flag per parameter
        self.buckets: list[Bucket] = build_buckets(self.params[::-1], bucket_mb * 2**20,
                                                   last_extra=1 + len(self.params))
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._scale = 1.0 / comm.mesh.size(axis)
        self._used: set[int] = set()
        self._next_launch = 0
        self._sync = True
        self.events: list[tuple[str, int, float]] = []  # (what, bucket, time): the overlap log
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params]
        self.zero_grad()

    # ---- the step -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: no gradients yet (each lands in its bucket as backward makes it)."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.reset()
        self._used.clear()
        self._next_launch = 0
        self.events.clear()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (earlier micro-batches): no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        first = id(param) not in self._used
        self._used.add(id(param))
        bucket, i = self._slot[id(param)]
        bucket.absorb(i, param.grad, self._scale, first)
        param.grad = None  # the bucket holds it now; the next one is autograd's to allocate
        if not self._sync or bucket is self.buckets[-1]:
            return
        self.events.append(("ready", bucket.index, time.perf_counter()))
        if bucket.mark_ready(param):
            self._launch_in_order(until=len(self.buckets) - 1)

    def _launch_in_order(self, until: int, final: bool = False) -> None:
        """Launch, in index order, the buckets before `until` that are ready (all if final)."""
        while self._next_launch < until:
            bucket = self.buckets[self._next_launch]
            if not (final or bucket.all_ready):
                return
            bucket.handle = self.comm.all_reduce(bucket.buffer, self.axis, op="sum",
                                                 tag="grad", async_op=True)
            self.events.append(("launch", bucket.index, time.perf_counter()))
            self._next_launch += 1

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """After the last backward: put the step's statistics in the last bucket, launch
        every bucket not yet launched, wait for all; return the global mean loss."""
        self.events.append(("backward_end", -1, time.perf_counter()))
        last = self.buckets[-1]
        for p in self.params:
            if id(p) not in self._used:  # no gradient on this rank: its slot must be zero
                bucket, i = self._slot[id(p)]
                bucket.absorb(i, None, self._scale, first=True)
        last.extra[0] = float(local_loss)
        last.extra[1:] = torch.tensor([id(p) in self._used for p in self.params])
        self._launch_in_order(until=len(self.buckets), final=True)
        for bucket in self.buckets:
            bucket.wait()
        self.events.append(("synced", -1, time.perf_counter()))
        users = last.extra[1:].tolist()  # summed: how many ranks used each parameter
        for p, used_by in zip(self.params, users):
            bucket, i = self._slot[id(p)]
            p.grad = bucket.grad_view(i) if used_by else None
        return last.extra[0].item() / self.comm.mesh.size(self.axis)

    # ---- the optimizer (slot 4) ------------------------------------------------------------
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """The user's optimizer over every parameter: DDP keeps whole replicas."""
        self.optimizer = factory(self.params)
        return self.optimizer

    def step(self) -> None:
        self.optimizer.step()

    # ---- after the sync: other axes, clipping ---------------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return self.named[name].grad

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        """Every replica holds every averaged gradient: dp rank 0 alone counts them."""
        total = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        if self.comm.mesh.axis_rank(self.axis) == 0:
            for name, p in self.named.items():
                if p.grad is not None and counted(name):
                    total += p.grad.double().square().sum()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    # ---- state ----------------------------------------------------------------------------
    def local_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named.items()}

    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        return (state_by_name(self.optimizer, self._name_of),
                param_groups_by_name(self.optimizer, self._name_of))

    @torch.no_grad()
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        for name, p in self.named.items():
            p.copy_(params[name])
        self.zero_grad()
        if optimizer_state is not None:
            load_state_by_name(self.optimizer, self.named, *optimizer_state)

    # ---- accounting ---------------------------------------------------------------------
    def memory(self) -> tuple[int, int, int]:
        return (storage_bytes(self.params), self.gradient_bytes,
                storage_bytes(optimizer_state_tensors(self.optimizer)))

    @property
    def gradient_bytes(self) -> int:
        return sum(b.gradient_numel * b.buffer.element_size() for b in self.buckets)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
