"""Mixed precision (`Plan(precision="bf16")`): what the model computes with against what the
optimizer steps.

In bf16 the model's parameters and gradients are bf16 (2 + 2 bytes per parameter, and half
the bytes on the wire) while the optimizer steps fp32 master weights with fp32 states: K = 12
bytes per parameter for Adam (ZeRO, Rajbhandari et al. 2020, §3.1 / Table 1). In fp32 the
parameters are their own masters: nothing is copied.

`MasterWeights` pairs each compute tensor (a parameter, or a flat shard of parameters) with
the tensor the optimizer owns: give it the reduced gradients before the optimizer step, and
it writes the updated masters back into the compute tensors after.
"""
from __future__ import annotations

import torch
from torch import nn

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    def write_back(self) -> None:
        """After the optimizer step: the compute tensors take the updated masters."""
        if self.separate:
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
