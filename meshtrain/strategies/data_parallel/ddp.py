"""DDP: one process per device, bucketed all-reduce overlapped with backward, no master.

Every data-parallel rank holds the whole model. At start, parameters are broadcast from dp
rank 0 so that all replicas begin identical. During backward, a hook on each parameter
marks its gradient ready; the moment a bucket's last gradient is ready its all-reduce
(average over dp) is launched asynchronously, so communication overlaps the rest of
backward. `finish_gradient_sync` launches what is left and waits.

[Note: launch order]
c10d requires every rank to issue collectives in the same order, but hooks can fire in a
slightly different order from bucket order. Buckets are therefore launched strictly in index
order: a ready bucket waits until every bucket before it has been launched.

[Note: parameters without a gradient]
A parameter unused in a step gets no hook call; its bucket is launched at the end (its slice
is zero). A parameter unused on *every* rank gets `.grad = None` before the optimizer step,
so the optimizer skips it exactly as it would in one process. Which parameters were used is
agreed on in `step_statistics`, the one small all-reduce per step that also carries the loss.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.strategies.data_parallel.buckets import Bucket, build_buckets


def broadcast_module(module: nn.Module, comm: Comm, axis: str = "dp") -> None:
    """Make every replica along `axis` equal to axis rank 0's (parameters and buffers)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(tensor.data, src=0, axis=axis, tag="init")


class DDP:
    """Gradient synchronisation for a model replicated along the mesh's dp axis."""

    def __init__(self, model: nn.Module, comm: Comm, bucket_mb: float, axis: str = "dp") -> None:
        self.model, self.comm, self.axis = model, comm, axis
        broadcast_module(model, comm, axis)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = build_buckets(self.params[::-1], bucket_mb * 2**20)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._used: set[int] = set()
        self._next_launch = 0
        self._sync = True
        self.events: list[tuple[str, int, float]] = []  # (what, bucket, time): the overlap log
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params]
        self.zero_grad()

    # ---- the step -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the buckets and make every .grad a view into them again."""
        for b in self.buckets:
            b.buffer.zero_()
            b.attach_grads()
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
        self._used.add(id(param))
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        self.events.append(("ready", bucket.index, time.perf_counter()))
        if bucket.mark_ready(param):
            self._launch_in_order(final=False)

    def _launch_in_order(self, final: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not (final or bucket.all_ready):
                return
            bucket.handle = self.comm.all_reduce(bucket.buffer, self.axis, op="avg",
                                                 tag="grad", async_op=True)
            self.events.append(("launch", bucket.index, time.perf_counter()))
            self._next_launch += 1

    def finish_gradient_sync(self) -> None:
        """After the last backward: launch the buckets still waiting, then wait for all."""
        self.events.append(("backward_end", -1, time.perf_counter()))
        self._launch_in_order(final=True)
        for bucket in self.buckets:
            bucket.wait()
        self.events.append(("synced", -1, time.perf_counter()))

    def step_statistics(self, loss_sum: torch.Tensor, count: int) -> torch.Tensor:
        """One small all-reduce for the step: global mean loss, and which parameters any
        rank used (see [Note: parameters without a gradient]). Returns the mean loss."""
        used = torch.tensor([id(p) in self._used for p in self.params], dtype=torch.float32,
                            device=loss_sum.device)
        stats = torch.cat([loss_sum.detach().reshape(1).float(),
                           torch.tensor([float(count)], device=loss_sum.device), used])
        self.comm.all_reduce(stats, self.axis, op="sum", tag="step")
        for p, users in zip(self.params, stats[2:].tolist()):
            if users == 0:
                p.grad = None
        return stats[0] / stats[1]

    # ---- accounting ---------------------------------------------------------------------
    @property
    def gradient_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
