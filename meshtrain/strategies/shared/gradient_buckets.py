"""Gradients flowing into buckets during backward, each bucket launched the moment it is full:
the machinery DDP and ZeRO share (they differ only in what a launch does).

A hook on each parameter moves its gradient, pre-scaled (by 1/N for a mean over N ranks),
into its bucket slot and frees autograd's copy; when a bucket's last gradient is in, the
owner's `launch(bucket)` starts its collective asynchronously, so communication overlaps the
rest of backward.

[Note: rounds]
A round is what one launch of every bucket carries. For DDP and ZeRO-1 it is the whole step:
micro-batches before the last accumulate in the buckets inside `no_sync`, without
communicating. For ZeRO-2 it is one micro-batch: each micro-batch's buckets are reduced at
once and freed, so that only a gradient shard outlives backward. The first gradient a slot
receives in a round overwrites it (no memset); a slot that received none is zeroed before
its bucket is launched.

[Note: a round's reach]
Under interleaved stages a rank holds several chunks, and one micro-batch's backward reaches
one chunk's parameters only. A round can therefore be limited to the buckets that hold them
(`start_round(reach)`): only those are launched, in index order, and flushed; the others
carry nothing this round and are not sent as zeros. The reach is the model's structure,
the same on every replica, never which gradients happened to arrive (that would let ranks
issue different collectives).

[Note: a chunk done]
Where a round is the step (DDP, ZeRO-1, ZeRO-3 kept under stages), an interleaved stage's
chunk is done before the step is: its last backward ran, no gradient comes to its buckets
any more. `launch_done` launches them then (their slots that got nothing zeroed), as far as
index order allows: the chunks end in reverse order, the order their buckets are laid out
in, so each chunk's exchange overlaps the backwards of the chunks still running (Megatron's
overlapped gradient reduction under interleaved stages). As with the reach, which buckets
are done is the schedule's structure, the same on every replica.

[Note: one replica]
With nothing to reduce (one replica, no scaling), `in_place` lets autograd accumulate
straight into the bucket slots: each step starts with the buckets zeroed and every .grad a
view of its slot, and autograd adds each micro-batch's gradient there in place (torch DDP's
`gradient_as_bucket_view`). The buckets' memory is what the hooks' copies use, allocated
once, but no Python runs per parameter and micro-batch beyond noting that the parameter got
a gradient (one who got none in the whole step ends with `.grad = None`).

[Note: launch order]
c10d requires every rank to issue collectives in the same order, but hooks can fire in a
slightly different order from bucket order. Buckets are therefore launched strictly in index
order: a ready bucket waits until every bucket before it has been launched.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from meshtrain.strategies.shared.buckets import Bucket


class GradientBuckets:
    """Hooks that fill `buckets` from backward and launch them in order through `launch`.

    `hold_last`: the last bucket is never launched from a hook (DDP puts the step's
    statistics in it at the end). `launch_in_no_sync`: ZeRO-2 launches during `no_sync` too
    (its rounds are micro-batches). `in_flight`: at most this many buckets launched and not
    yet waited for; launching one more first waits for the oldest (ZeRO: a reduce-scatter
    holds its bucket and a receive buffer until waited, and ZeRO-2/3 free the bucket then;
    unbounded, every bucket of the round stayed alive to the end of backward)."""

    def __init__(self, params: list[nn.Parameter], buckets: list[Bucket],
                 launch: Callable[[Bucket], object], scale: float, hold_last: bool = False,
                 launch_in_no_sync: bool = False, in_flight: int | None = None,
                 in_place: bool = False) -> None:
        self.params, self.buckets, self._launch = params, buckets, launch
        self.in_place = in_place   # see [Note: one replica]
        self.scale, self.hold_last, self.launch_in_no_sync = scale, hold_last, launch_in_no_sync
        self.in_flight = in_flight
        self._slot = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self.used_in_step: set[int] = set()     # parameters that got a gradient this step
        self._in_round: set[int] = set()        # ... this round (see [Note: rounds])
        self._reach: set[int] | None = None   # see [Note: a round's reach]
        self._round = buckets                 # the buckets this round launches, in order
        self._next_launch = 0
        self.syncing = True
        self.events: list[tuple[str, int, float]] = []  # (what, bucket, time): the overlap log
        used = self.used_in_step
        self._hooks = [p.register_post_accumulate_grad_hook(
            (lambda param: used.add(id(param))) if in_place else self._on_grad_ready)
            for p in params]

    @contextmanager
    def paused(self):
        """Gradients accumulate in the buckets without launching anything (the earlier
        micro-batches of a step); the caller's `no_sync`."""
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous

    def start_step(self) -> None:
        self.used_in_step.clear()
        self.events.clear()
        if self.in_place:
            for b in self.buckets:
                b.buffer.zero_()
                for p, view in zip(b.params, b.views):
                    p.grad = view
            return
        for p in self.params:
            p.grad = None
        self.start_round()

    def holding(self, params) -> set[int]:
        """The indices of the buckets holding any of `params`."""
        return {self._slot[id(p)][0].index for p in params if id(p) in self._slot}

    def launch_done(self, done: set[int]) -> None:
        """The buckets `done` get no more gradients this step: launch them (see [Note: a
        chunk done])."""
        for bucket in self._round[self._next_launch:]:
            if bucket.index in done and not bucket.all_ready:
                self._zero_missing(bucket)
                bucket.mark_all_ready()
        self._launch_ready(until=len(self._round) - (1 if self.hold_last else 0))

    def _zero_missing(self, bucket: Bucket) -> None:
        """The slots of `bucket` that got no gradient this round, zeroed (allocated first)."""
        if bucket.buffer is None:
            self._allocate(bucket)
        for i, p in enumerate(bucket.params):
            if id(p) not in self._in_round:
                bucket.absorb(i, None, self.scale, first=True)

    def start_round(self, reach: set[int] | None = None) -> None:
        """A new round; `reach`: the indices of the only buckets its backward can fill
        (see [Note: a round's reach]), None for all."""
        if reach is not None and self.hold_last:
            raise ValueError("a round's reach cannot be limited with hold_last (DDP's "
                             "statistics ride in the last bucket of every step)")
        for b in self.buckets:
            b.reset()
        self._reach = reach
        self._round = (self.buckets if reach is None
                       else [b for b in self.buckets if b.index in reach])
        self._in_round.clear()
        self._next_launch = 0

    buffers_peak = 0   # bytes: the most lazily made bucket buffers alive at once

    def slot(self, param: nn.Parameter) -> tuple[Bucket, int]:
        return self._slot[id(param)]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        first = id(param) not in self._in_round
        self._in_round.add(id(param))
        self.used_in_step.add(id(param))
        bucket, i = self._slot[id(param)]
        if self._reach is not None and bucket.index not in self._reach:
            raise RuntimeError(f"a gradient reached bucket {bucket.index}, outside the round's "
                               "reach: the backward reached a parameter its caller said it "
                               "would not (see [Note: a round's reach])")
        if bucket.buffer is None:
            self._allocate(bucket)
        bucket.absorb(i, param.grad, self.scale, first)
        param.grad = None  # the bucket holds it now; the next one is autograd's to allocate
        if not (self.syncing or self.launch_in_no_sync):
            return
        if self.hold_last and bucket is self.buckets[-1]:
            return
        self.events.append(("ready", bucket.index, time.perf_counter()))
        if bucket.mark_ready(param):
            self._launch_ready(until=len(self._round) - (1 if self.hold_last else 0))

    def _allocate(self, bucket: Bucket) -> None:
        """A lazy bucket's buffer, made as its first gradient arrives; the most bytes of
        buffers alive at once is kept (what ZeRO-2/3's memory accounts for them)."""
        bucket.allocate()
        alive = sum(b.nbytes for b in self.buckets if b.buffer is not None)
        self.buffers_peak = max(self.buffers_peak, alive)

    def _launch_ready(self, until: int) -> None:
        """Launch, in index order, the buckets before `until` that are ready."""
        while self._next_launch < until and self._round[self._next_launch].all_ready:
            self._launch_next()

    def _launch_next(self) -> None:
        if self.in_flight is not None and self._next_launch >= self.in_flight:
            self._round[self._next_launch - self.in_flight].wait()
        bucket = self._round[self._next_launch]
        bucket.handle = self._launch(bucket)
        self.events.append(("launch", bucket.index, time.perf_counter()))
        self._next_launch += 1

    def flush(self) -> None:
        """End of a round: zero the slots that got nothing, launch every bucket not yet
        launched (in order)."""
        self.events.append(("backward_end", -1, time.perf_counter()))
        for bucket in self._round[self._next_launch:]:
            self._zero_missing(bucket)
        while self._next_launch < len(self._round):
            self._launch_next()

    def wait(self) -> None:
        for bucket in self.buckets:
            bucket.wait()
        self.events.append(("synced", -1, time.perf_counter()))

    def used_flags(self) -> torch.Tensor:
        """1.0 for each parameter that got a gradient this step, in `params` order."""
        # on the parameters' device: the flags travel with the loss in one collective. A
        # GPU takes them from pinned memory without blocking: a copy from pageable host
        # memory would wait for the device's queued work (a host sync every step)
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor([float(id(p) in self.used_in_step) for p in self.params],
                             device="cpu", pin_memory=device.type == "cuda")
        return flags.to(device, non_blocking=True)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
