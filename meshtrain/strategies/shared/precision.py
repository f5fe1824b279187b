"""Mixed precision (`Plan(precision="bf16")`): what the model computes with against what the
optimizer steps.

In bf16 the model's parameters and gradients are bf16 (2 + 2 bytes per parameter, and half
the bytes on the wire) while the optimizer steps fp32 master weights with fp32 states: K = 12
bytes per parameter for Adam (ZeRO, Rajbhandari et al. 2020, §3.1 / Table 1). In fp32 the
parameters are their own masters: nothing is copied.

`MasterWeights` pairs each compute tensor (a parameter, or a flat shard of parameters) with
the tensor the optimizer owns: give it the reduced gradients before the optimizer step, and
it writes the updated masters back into the compute tensors after. `flatten` lays them out
in one flat tensor per group (DDP's buckets), so that a step's gradient cast and write-back
are one copy per group instead of one per parameter (each a kernel launch on a GPU).
"""
from __future__ import annotations

import torch
from torch import nn

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16,
                  "fp8": torch.bfloat16}   # fp8: bf16 outside the float8 matmuls


class MasterWeights:
    def __init__(self, compute: list[torch.Tensor], precision: str,
                 initial: list[torch.Tensor] | None = None,
                 device: torch.device | None = None) -> None:
        """`initial`: the masters' fp32 starting values, where the compute tensors were
        already made bf16 (default: the compute tensors' own values). `device`: where the
        masters live (the host, under offload; default: with the compute tensors)."""
        self.compute = compute
        self._copies = None   # CUDA: the event after write_back's asynchronous copies
        self.mixed = precision != "fp32"
        device = device or (compute[0].device if compute else torch.device("cpu"))
        # masters of their own in bf16, or when they live elsewhere (offload to the host)
        self.separate = self.mixed or any(t.device != device for t in compute)
        # otherwise the optimizer steps the compute tensors themselves (a parameter as it
        # is, a flat shard wrapped as a Parameter sharing its storage)
        self.masters = [nn.Parameter(v.detach().to(device, torch.float32 if self.mixed
                                                    else v.dtype, copy=True))
                        if self.separate else t if isinstance(t, nn.Parameter)
                        else nn.Parameter(t.detach())
                        for t, v in zip(compute, initial or compute)]
        self._host_grads: list[torch.Tensor | None] = [None] * len(self.masters)
        self._groups: list[_FlatGroup] = []   # flatten's
        self._grad_views: list[torch.Tensor] = []   # master i's gradient, in its group's flat

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        """The gradients the optimizer sees (fp32, where the masters are; a None skips that
        master). Into pinned masters (offload beside a GPU) they are copied without blocking
        into pinned buffers kept between steps, all queued before one event is waited for."""
        self._copied_out()
        queued = False
        for i, (master, grad) in enumerate(zip(self.masters, grads)):
            if grad is None:
                master.grad = None
            elif master.is_pinned() and grad.is_cuda:
                master.grad = self._host_grad(i, master)
                master.grad.copy_(grad, non_blocking=True)
                queued = True
            elif self.separate or grad.device != master.device:
                # a master that is its compute tensor may still live elsewhere than the
                # gradient: ZeRO-3's shards offloaded to disk, beside a GPU
                master.grad = grad.to(master.device, master.dtype)
            else:
                master.grad = grad
        if queued:   # the optimizer reads them on the host: the copies must have landed
            copied = torch.cuda.Event()
            copied.record()
            copied.synchronize()

    def grad_buffers(self) -> list[torch.Tensor]:
        """The pinned gradient buffers kept between steps (one per master that has had a
        gradient copied from a GPU)."""
        return [g for g in self._host_grads if g is not None]

    def _host_grad(self, i: int, master: torch.Tensor) -> torch.Tensor:
        """Master i's pinned gradient buffer (the optimizer's step leaves it unused until
        the next `set_grads` overwrites it)."""
        if self._host_grads[i] is None:
            self._host_grads[i] = torch.empty_like(master, pin_memory=True)
        return self._host_grads[i]

    @torch.no_grad()
    def flatten(self, groups: list[list[torch.Tensor]]) -> None:
        """Lay each group's compute tensors out in one flat tensor, in the group's order, and
        their masters likewise (values kept, each tensor now a view of its group's flat):
        then `set_group_grads` and `write_back` copy whole groups. Mixed precision only (in
        fp32 the masters are the compute tensors). The groups' fp32 gradients live only from
        `set_group_grads` to `write_back`, as `set_grads`' per-parameter copies do."""
        index = {id(t): i for i, t in enumerate(self.compute)}
        views = [None] * len(self.masters)
        for group in groups:
            order = [index[id(t)] for t in group]
            compute = torch.cat([self.compute[i].detach().reshape(-1) for i in order])
            masters = torch.cat([self.masters[i].detach().reshape(-1) for i in order])
            grads = torch.empty_like(masters)
            offset = 0
            for i in order:
                shape, n = self.compute[i].shape, self.compute[i].numel()
                self.compute[i].data = compute[offset:offset + n].view(shape)
                self.masters[i].data = masters[offset:offset + n].view(shape)
                views[i] = grads[offset:offset + n].view(shape)
                offset += n
            grads.untyped_storage().resize_(0)   # allocated by each set_group_grads
            self._groups.append(_FlatGroup(compute, masters, grads))
        self._grad_views = views

    @torch.no_grad()
    def set_group_grads(self, flats: list[torch.Tensor], used: list[bool]) -> None:
        """`set_grads` for flattened masters: each group's gradients as one flat tensor laid
        out as the group (a bucket), cast into the masters' dtype in one copy; `used[i]`
        False leaves master i without a gradient (the optimizer skips it)."""
        for group, flat in zip(self._groups, flats):
            group.grads.untyped_storage().resize_(group.grads.numel() * group.grads.itemsize)
            group.grads.copy_(flat)
        for master, view, is_used in zip(self.masters, self._grad_views, used):
            master.grad = view if is_used else None

    @torch.no_grad()
    def write_back(self) -> None:
        """After the optimizer step: the compute tensors take the updated masters."""
        if self._groups:
            for group in self._groups:
                group.compute.copy_(group.masters)
                group.grads.untyped_storage().resize_(0)
            for master in self.masters:
                master.grad = None
        elif self.separate:
            for master, tensor in zip(self.masters, self.compute):
                # from pinned host memory (offload beside a GPU): queued on the stream, the
                # master left untouched until `_copied_out` sees the copy done
                tensor.copy_(master, non_blocking=master.is_pinned())
                master.grad = None   # fp32 copies of the gradients (pinned ones are reused)
            if self.compute and self.compute[0].is_cuda:
                self._copies = torch.cuda.Event()
                self._copies.record()

    def _copied_out(self) -> None:
        """Wait for write_back's asynchronous copies before a master is written again."""
        if self._copies is not None:
            self._copies.synchronize()
            self._copies = None

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        self._copied_out()
        for master, tensor, value in zip(self.masters, self.compute, values):
            master.copy_(value)
            if self.separate:
                tensor.copy_(value)


class _FlatGroup:
    """One group of `MasterWeights.flatten`: its compute tensors', masters' and the masters'
    gradients' flat tensors (the gradients' storage empty between steps)."""

    def __init__(self, compute: torch.Tensor, masters: torch.Tensor,
                 grads: torch.Tensor) -> None:
        self.compute, self.masters, self.grads = compute, masters, grads


@torch.no_grad()
def cast_to(precision: str, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
    """Make the model compute in bf16 under mixed precision (floating parameters and
    buffers); in "fp32" the model keeps its own dtype (a float64 model stays float64)."""
    if precision == "fp32":
        return
    dtype = COMPUTE_DTYPES[precision]
    for t in [*params, *buffers]:
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)
