"""Gradient buckets: flat buffers that own a group of parameters' gradients.

A bucket holds its parameters' gradients as views into one flat buffer, so that a single
collective moves them all (DDP all-reduces it; ZeRO reduce-scatters it). The protocol is
small: `absorb` (add a freshly computed gradient into its slot), `grad_view` (the slot, as
the parameter's .grad once the step's gradients are final), `mark_ready` (True when the last
gradient arrived), `launch`-ed elsewhere into `handle`, `wait`, `reset`; and, for a bucket
whose buffer lives only while it is in flight (ZeRO-2), `allocate` / `release`.

Buckets are filled in reverse order of the parameters' registration: backward produces the
last layers' gradients first, so the first bucket is ready earliest and its communication
overlaps the rest of backward. After its gradients a bucket may carry `extra` elements:
padding (so that N ranks split it exactly) and a small payload (DDP's step statistics)
that travels in the same collective for free.
"""
from __future__ import annotations

import torch
from torch import nn


class Bucket:
    """One flat gradient buffer, the parameters whose gradients live in it, a ready set."""

    def __init__(self, index: int, params: list[nn.Parameter], extra: int = 0,
                 dtype: torch.dtype | None = None, lazy: bool = False) -> None:
        self.index = index
        self.params = params
        self.offsets: list[int] = []
        self.shapes = [p.shape for p in params]   # kept: ZeRO-3 empties its parameters
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.gradient_numel = numel
        self.numel = numel + extra
        self.dtype = dtype or params[0].dtype
        self.device = params[0].device
        self.buffer: torch.Tensor | None = None
        self._ready: set[int] = set()
        self.handle = None  # the in-flight collective's work handle, if launched
        if not lazy:
            self.allocate()

    def allocate(self) -> None:
        """Give the bucket a buffer (uninitialised: `absorb` overwrites each slot first)."""
        self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.extra = self.buffer[self.gradient_numel:]
        # each parameter's slot, made once per buffer: building a view costs ~7 us, twice
        # per parameter per step otherwise
        self.views = [self.buffer[o:o + shape.numel()].view(shape)
                      for o, shape in zip(self.offsets, self.shapes)]

    def release(self) -> None:
        """Drop the buffer (its contents were consumed)."""
        self.buffer = None
        self.views = []
        self.extra = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def grad_view(self, i: int) -> torch.Tensor:
        return self.views[i]

    def absorb(self, i: int, grad: torch.Tensor | None, scale: float, first: bool) -> None:
        """Put `grad` * `scale` into the i-th slot: overwrite it with the first gradient of
        the round (so the buffer never needs zeroing), add later ones (accumulation). A None
        gradient on first arrival zeroes the slot. One fused pass, as torch DDP's mul_out;
        the slot may be wider than the gradient (bf16 gradients summed in fp32)."""
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

    def mark_all_ready(self) -> None:
        self._ready = {id(p) for p in self.params}

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


def build_buckets(params: list[nn.Parameter], bucket_bytes: float, last_extra: int = 0,
                  pad_to: int = 1, dtype: torch.dtype | None = None, lazy: bool = False,
                  groups: list[list[nn.Parameter]] | None = None,
                  first_bytes: float | None = None) -> list[Bucket]:
    """Group `params` (in the order given) into buckets of about `bucket_bytes` each.

    A bucket closes once it reaches the cap (the first one at `first_bytes` where given, as
    torch DDP's first bucket of 1 MiB: the gradients backward makes first start
    communicating early); a parameter larger than the cap gets a bucket of its own.
    Parameters of different dtype or device never share a bucket, nor do parameters of
    different `groups` (each group's buckets come first, in the order given; `params` are
    what no group took). Each bucket's length is padded to a multiple of `pad_to`; the last
    bucket gets `last_extra` payload elements after its padding."""
    taken = {id(p) for g in groups or [] for p in g}
    rest = [p for p in params if id(p) not in taken]
    runs: list[list[nn.Parameter]] = []
    for group in [*(groups or []), rest]:
        current: list[nn.Parameter] = []
        size = 0
        for p in group:
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                runs.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= (first_bytes if first_bytes is not None and not runs
                        else bucket_bytes):
                runs.append(current)
                current, size = [], 0
        if current:
            runs.append(current)
    buckets = []
    for i, run in enumerate(runs):
        numel = sum(p.numel() for p in run)
        extra = (-numel) % pad_to + (last_extra if i == len(runs) - 1 else 0)
        buckets.append(Bucket(i, run, extra=extra, dtype=dtype, lazy=lazy))
    return buckets
