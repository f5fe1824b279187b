"""DP with a master device (`Plan(dp=N, dp_mode="dp")`): one process, N replicas, one thread
per replica, everything funnelled through replica 0, the master (torch's nn.DataParallel).

Each step:

    replicate   the master's parameters and buffers are copied into replicas 1..N-1
    scatter     each micro-batch is cut into N slices along dim 0, one per replica
    forward     the replicas run their slices in parallel threads
    gather      the outputs are concatenated on the master, which computes the loss
    backward    dLoss/dOutput is cut as the outputs were; each replica runs its backward in
                its thread (gradients accumulate on the replica over micro-batches)
    reduce      the replicas' gradients are summed onto the master (in replica order)
    step        the optimizer, built over the master's parameters, steps there

So the master carries (N-1)*S of parameters out and (N-1)*S of gradients in per step (S the
parameter bytes), beside the batch slices and outputs: the load that makes DP a one-machine
strategy. Every copy is charged to the Comm's counters on axis "dp" (op "send" for what
leaves the master, "recv" for what comes back, one call per message), so the report shows
it like any other traffic although nothing crosses a process boundary.

On CPU the "devices" are the cores: each replica's thread gets cores / N intra-op threads.
"""
from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.device import to_device
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.optim_state import load_state_by_name, param_groups_by_name, state_by_name
from meshtrain.core.plan import PlanError
from meshtrain.models.registry import logits_of
from meshtrain.strategies.compile import recompile_copy
from meshtrain.strategies.slots import GradientSync, split_microbatches

AXIS = "dp"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MasterDP(GradientSync):
    """Slots 3 and 4 for dp_mode="dp": the replicas agree by reducing their gradients onto
    the master, whose optimizer owns the update."""

    def __init__(self, model: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 comm: Comm, replicas: int) -> None:
        self.comm, self.n = comm, replicas
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self._name_of = {id(p): n for n, p in self.named.items()}
        # replica 0 is the master itself; the others are copies refreshed every step
        self.replicas = [model] + [copy.deepcopy(model) for _ in range(replicas - 1)]
        for replica in self.replicas[1:]:
            recompile_copy(replica)
        self.param_bytes = _nbytes(self.named.values())

    # ---- the step (slot 3) ------------------------------------------------------------------
    @torch.no_grad()
    def zero_grad(self) -> None:
        """Start a step: no gradients anywhere, every replica a copy of the master."""
        master = self.replicas[0]
        for replica in self.replicas:
            for p in replica.parameters():
                p.grad = None
        for replica in self.replicas[1:]:
            for mine, theirs in zip(replica.parameters(), master.parameters()):
                mine.copy_(theirs)
            for mine, theirs in zip(replica.buffers(), master.buffers()):
                mine.copy_(theirs)
            self.record("send", "param", sent=self.param_bytes)

    def no_sync(self):
        return nullcontext()   # gradients stay on the replicas until the step's end anyway

    @torch.no_grad()
    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Sum every replica's gradients onto the master; the loss is already global."""
        masters = list(self.replicas[0].parameters())
        for replica in self.replicas[1:]:
            for master, p in zip(masters, replica.parameters()):
                if p.grad is None:
                    continue
                if master.grad is None:
                    master.grad = p.grad.clone()
                else:
                    master.grad.add_(p.grad)
            self.record("recv", "grad", received=self.param_bytes)
        return local_loss.item()

    def record(self, op: str, tag: str, sent: int = 0, received: int = 0) -> None:
        """Charge one master <-> replica copy to the counters (see the module docstring)."""
        self.comm.stats.record(AXIS, op, tag, sent, received)

    # ---- the optimizer (slot 4) -------------------------------------------------------------
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        self.optimizer = factory(list(self.named.values()))
        return self.optimizer

    def step(self) -> None:
        self.optimizer.step()

    # ---- slot 5: the replicas are threads of this process, not ranks -------------------------
    def step_driver(self, loss_fn: Callable, microbatches: int,
                    device: torch.device) -> ReplicaLoop:
        return ReplicaLoop(self, loss_fn, microbatches, device)

    # ---- after the sync: clipping -----------------------------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return self.named[name].grad

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        for name, p in self.named.items():
            if p.grad is not None and counted(name):
                total += p.grad.double().square().sum()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for p in self.named.values():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    # ---- state ------------------------------------------------------------------------------
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
        if optimizer_state is not None:
            load_state_by_name(self.optimizer, self.named, *optimizer_state)

    def remove_hooks(self) -> None:
        """No hooks: the replicas' gradients are reduced after backward."""

    def memory(self) -> dict[str, int]:
        """The master's states plus its replicas' parameters and gradients (all in this
        process: the master device's load)."""
        params = [p for r in self.replicas for p in r.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads),
                "optimizer_states": storage_bytes(optimizer_state_tensors(self.optimizer))}


class ReplicaLoop:
    """Slot 5 for dp_mode="dp": each micro-batch scattered over the replicas, their forwards
    and backwards in parallel threads, the loss on the master (see the module docstring)."""

    def __init__(self, sync: MasterDP, loss_fn: Callable, microbatches: int,
                 device: torch.device) -> None:
        self.sync, self.loss_fn, self.microbatches, self.device = sync, loss_fn, microbatches, device
        self.n = sync.n
        self.pool = ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="dp-replica")
        self.threads = max(1, (os.cpu_count() or 1) // self.n)   # each replica's share

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, sync: MasterDP) -> torch.Tensor:
        micro_inputs = split_microbatches(inputs, self.microbatches)
        micro_targets = split_microbatches(targets, self.microbatches)
        loss_sum = torch.zeros((), device=self.device)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)   # N threads share the cores, as N devices would
        try:
            for x, y in zip(micro_inputs, micro_targets):
                x, y = to_device(x, self.device), to_device(y, self.device)
                loss_sum += self._microbatch(x, y)
        finally:
            torch.set_num_threads(previous)
        return loss_sum

    def _microbatch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.n:
            raise PlanError(f"a micro-batch of {x.shape[0]} cannot be scattered over dp={self.n} "
                            f"replicas; use micro-batches of at least {self.n} samples")
        slices = list(x.tensor_split(self.n))   # scatter: replica i takes slice i
        sync = self.sync
        for s in slices[1:]:
            sync.record("send", "batch", sent=_nbytes([s]))
        # a transformers model's output: its logits are what the loss reads (models/registry.py)
        outputs = [logits_of(o) for o in self.pool.map(lambda r, s: r(s), sync.replicas, slices)]
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise PlanError("dp_mode='dp' gathers the replicas' outputs along dim 0 and needs "
                            "the model to return a tensor or an output with .logits (got "
                            f"{type(outputs[0]).__name__}); use dp_mode='ddp'")
        for o in outputs[1:]:
            sync.record("recv", "output", received=_nbytes([o]))
        # gather: the loss sees one tensor, as in one process; its gradient is cut back
        gathered = torch.cat([o.detach() for o in outputs]).requires_grad_()
        loss = self.loss_fn(gathered, y) / self.microbatches
        loss.backward()
        output_grads = gathered.grad.split([o.shape[0] for o in outputs])
        for g in output_grads[1:]:
            sync.record("send", "output-grad", sent=_nbytes([g]))
        list(self.pool.map(lambda o, g: o.backward(g), outputs, output_grads))
        return loss.detach()

    def global_loss(self, dp_mean: float) -> float:
        return dp_mean

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        master = self.sync.replicas[0]
        return float(self.loss_fn(master(to_device(inputs, self.device)),
                                  to_device(targets, self.device)))
