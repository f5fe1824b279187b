"""One parameter-server shard: the master copy of a contiguous slice of the flat parameters,
the optimizer over it, and the gradients pushed for each step until they are all in.

The server is a role, not a process: shard k lives on dp rank k beside that rank's worker
(parameter_server.py). It knows nothing of transport; the sync and async schedules hand it
pushes and ask it for the parameters to send back.

[Note: versions]
A shard's version is the number of optimizer steps it has taken. The gradients of a worker's
step t are applied by the update that takes the shard from version t to t + 1, once all N
workers' gradients for step t are in (they are summed as they arrive). A push computed on
version p and applied at version t is t - p versions stale; synchronous updates are the case
where every push is computed on the version it is applied to (staleness 0), which is why
ps-async with staleness 0 is exactly ps-sync, and both are exactly DDP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class Pending:
    """Step t's gradients received so far: their sum, how many pushes, their losses' sum."""
    grad: torch.Tensor
    pushes: int = 0
    loss: float = 0.0
    workers: list[int] = field(default_factory=list)


class ServerShard:
    """The master values of one shard, the optimizer over them, and the update rule."""

    def __init__(self, index: int, values: torch.Tensor, workers: int) -> None:
        self.index, self.workers = index, workers
        # a copy, not a view of the worker's parameters: workers read a version only when
        # they pull it, whatever the server does meanwhile
        self.master = nn.Parameter(values.detach().clone())
        self.version = 0
        self.pending: dict[int, Pending] = {}
        self.losses: dict[int, float] = {}     # step -> mean loss over the workers
        self.staleness: list[tuple[int, int, int]] = []   # (worker, step, versions stale)

    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        self.optimizer = factory([self.master])
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("a parameter server steps flat shards that cut through "
                             "parameters: the optimizer must put them all in one group")
        return self.optimizer

    def accept(self, worker: int, step: int, computed_on: int, grad: torch.Tensor,
               loss: float) -> None:
        """Add one worker's gradient for `step` (computed on version `computed_on`)."""
        pending = self.pending.get(step)
        if pending is None:
            pending = self.pending[step] = Pending(torch.zeros_like(self.master))
        pending.grad.add_(grad)
        pending.pushes += 1
        pending.loss += loss
        pending.workers.append(worker)
        self.staleness.append((worker, step, step - computed_on))

    def ready(self) -> bool:
        """Whether every worker's gradient for the next update is in."""
        pending = self.pending.get(self.version)
        return pending is not None and pending.pushes == self.workers

    def reduced(self) -> torch.Tensor:
        """The summed gradient of the next update (to clip before `update`)."""
        return self.pending[self.version].grad

    @torch.no_grad()
    def update(self) -> None:
        """Step the optimizer with the next update's summed gradient: version += 1."""
        pending = self.pending.pop(self.version)
        self.master.grad = pending.grad
        self.optimizer.step()
        self.master.grad = None
        self.losses[self.version] = pending.loss / self.workers
        self.version += 1
