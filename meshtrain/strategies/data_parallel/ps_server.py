"""One parameter-server shard: the master copy of a contiguous slice of the flat parameters,
the optimizer over it, and the pushed gradients not applied yet.

The server is a role, not a process: shard k lives on dp rank k beside that rank's worker
(parameter_server.py). It knows nothing of transport; the sync and async schedules hand it
pushes and ask it whether it may update.

[Note: versions and staleness]
A shard's version is the number of updates it has applied. Each push is a worker's gradient
(scaled by 1/N: one N-th of a global batch) computed on some version p; pushes are summed as
they arrive, and an update applies the sum of those in hand as one optimizer step. A push
applied by the update that leaves version v is v - p versions stale.

The shard may update as soon as it holds a push, unless a worker still computing could then
be applied staler than the bound s: a worker whose last push was computed on p computes its
next gradient on p + 1 or newer (it waits for a version newer than p), so the update is
allowed while v + 1 - (p + 1) <= s for every such worker. With s = 0 the shard therefore
waits for all N pushes of a version and applies them together: the synchronous update,
which is why ps-async with staleness 0 equals ps-sync, and both equal DDP. With s > 0, fast
workers' pushes are applied as they come while a straggler's lag stays within s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class Pending:
    """Pushes received and not yet applied: their sum, and (worker, version, loss) each."""
    grad: torch.Tensor
    pushes: list[tuple[int, int, float]] = field(default_factory=list)


class ServerShard:
    """The master values of one shard, the optimizer over them, and the update rule."""

    def __init__(self, index: int, values: torch.Tensor, workers: int) -> None:
        self.index, self.workers = index, workers
        # a copy, not a view of the worker's parameters: workers read a version only when
        # they pull it, whatever the server does meanwhile
        self.master = nn.Parameter(values.detach().clone())
        self.version = 0
        self.pending = Pending(torch.zeros_like(self.master))
        self.floor = {w: 0 for w in range(workers)}   # oldest version w may compute on next
        self.done: set[int] = set()                   # workers that will push no more
        self.losses: dict[int, float] = {}            # version -> mean loss of its pushes
        self.staleness: list[tuple[int, int, int]] = []   # (worker, version computed on,
        self.history: list[tuple[float, int, int]] = []   # versions stale); (time, version,
        #                                                     pushes) of every update

    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        self.optimizer = factory([self.master])
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("a parameter server steps flat shards that cut through "
                             "parameters: the optimizer must put them all in one group")
        return self.optimizer

    def accept(self, worker: int, computed_on: int, grad: torch.Tensor, loss: float) -> None:
        """Add one worker's gradient, computed on version `computed_on`."""
        self.pending.grad.add_(grad)
        self.pending.pushes.append((worker, computed_on, loss))
        self.floor[worker] = computed_on + 1

    def may_update(self, staleness: int) -> bool:
        """Whether applying the pushes in hand now keeps every worker still computing within
        `staleness` (see [Note: versions and staleness])."""
        if not self.pending.pushes:
            return False
        pushed = {w for w, _, _ in self.pending.pushes}
        computing = [w for w in range(self.workers) if w not in pushed and w not in self.done]
        return all(self.version + 1 - self.floor[w] <= staleness for w in computing)

    def reduced(self) -> torch.Tensor:
        """The summed gradient of the next update (to clip before `update`)."""
        return self.pending.grad

    @torch.no_grad()
    def update(self) -> None:
        """Step the optimizer with the pushes in hand: version += 1."""
        pending, self.pending = self.pending, Pending(torch.zeros_like(self.master))
        self.master.grad = pending.grad
        self.optimizer.step()
        self.master.grad = None
        self.staleness += [(w, p, self.version - p) for w, p, _ in pending.pushes]
        self.version += 1
        self.losses[self.version] = sum(l for _, _, l in pending.pushes) / len(pending.pushes)
        self.history.append((time.monotonic(), self.version, len(pending.pushes)))
