"""Gradient buckets: flat buffers that own a group of parameters' gradients.

A bucket holds its parameters' gradients as views into one flat buffer, so that a single
collective moves them all (DDP all-reduces it; ZeRO-2 will reduce-scatter the same buffer).
The protocol is small: `absorb` (add a freshly computed gradient into its slot), `grad_view`
(the slot, as the parameter's .grad once the step's gradients are final), `mark_ready` (True
when the last gradient arrived), `launch`-ed elsewhere into `handle`, `wait`, `reset`.

Buckets are filled in reverse order of the parameters' registration: backward produces the
last layers' gradients first, so the first bucket is ready earliest and its communication
overlaps the rest of backward. A bucket may carry `extra` elements after its gradients: a
small payload (DDP's step statistics) that travels in the same collective for free.
"""
from __future__ import annotations

import torch
from torch import nn


class Bucket:
    """One flat gradient buffer, the parameters whose gradients live in it, a ready set."""

    def __init__(self, index: int, params: list[nn.Parameter], extra: int = 0) -> None:
        self.index = index
        self.params = params
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        first = params[0]
        self.buffer = torch.zeros(numel + extra, dtype=first.dtype, device=first.device)
        self.gradient_numel = numel
        self.extra = self.buffer[numel:]  # the payload after the gradients (may be empty)
        # each parameter's slot, made once: building a view costs ~7 us, twice per parameter
        # per step otherwise
        self.views = [self.buffer[o:o + p.numel()].view_as(p)
                      for o, p in zip(self.offsets, params)]
        self._ready: set[int] = set()
        self.handle = None  # the in-flight collective's work handle, if launched

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def grad_view(self, i: int) -> torch.Tensor:
        return self.views[i]

    def absorb(self, i: int, grad: torch.Tensor | None, scale: float, first: bool) -> None:
        """Put `grad` * `scale` into the i-th slot: overwrite it with the step's first
        gradient (so the buffer never needs zeroing), add later ones (accumulation). A None
        gradient on first arrival zeroes the slot. One fused pass, as torch DDP's mul_out."""
        view = self.grad_view(i)
        if grad is None:
            if first:
                view.zero_()
        elif first:
            torch.mul(grad, scale, out=view)
        else:
            view.add_(grad, alpha=scale)

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Record that `param`'s gradient is final; True once every gradient here is."""
        self._ready.add(id(param))
        return self.all_ready

    @property
    def all_ready(self) -> bool:
        return len(self._ready) == len(self.params)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reset(self) -> None:
        self._ready.clear()
        self.handle = None


def build_buckets(params: list[nn.Parameter], bucket_bytes: float,
                  last_extra: int = 0) -> list[Bucket]:
    """Group `params` (in the order given) into buckets of about `bucket_bytes` each.

    A bucket closes once it reaches the cap; a parameter larger than the cap gets a bucket
    of its own. Parameters of different dtype or device never share a bucket. The last
    bucket gets `last_extra` payload elements."""
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and (p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
    if current:
        buckets.append(Bucket(len(buckets), current))
    if last_extra:
        last = buckets[-1]
        buckets[-1] = Bucket(last.index, last.params, extra=last_extra)
    return buckets
