"""The Trainer: builds the strategy stack a Plan describes and runs training steps.

    trainer = Trainer(model, Plan(dp=2), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    loss = trainer.step(inputs, targets)   # this rank's dp shard; returns the global mean loss

Strategies are applied to the model in place, in a fixed order, by plain functions; the
Trainer only sequences them. Today the stack is DDP along the dp axis (with Plan(dp=1) it is
one process: every collective is a no-op). A Plan asking for a strategy not built yet is
refused by name before anything is built.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import (ActivationMeter, MemoryReport, optimizer_state_tensors,
                                   peak_process_bytes, storage_bytes)
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import Plan, PlanError
from meshtrain.strategies.data_parallel.ddp import DDP
from meshtrain.train import checkpoint

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def refuse_unbuilt(plan: Plan) -> None:
    """Name the first strategy in `plan` that meshtrain cannot run yet."""
    unbuilt = [
        (plan.pp > 1, f"pipeline parallel (pp={plan.pp}): pipeline schedules are not "
                      "available yet"),
        (plan.tp > 1, f"tensor parallel (tp={plan.tp}) is not available yet"),
        (plan.zero > 0, f"ZeRO (zero={plan.zero}) is not available yet"),
        (plan.dp_mode != "ddp", f"dp_mode={plan.dp_mode!r} is not available yet "
                                "(only 'ddp' is)"),
        (plan.precision != "fp32", f"precision={plan.precision!r} is not available yet "
                                   "(only 'fp32' is)"),
    ]
    for applies, message in unbuilt:
        if applies:
            raise PlanError(f"{message}; use a data-parallel plan such as Plan(dp=N)")


class Trainer:
    def __init__(self, model: nn.Module, plan: Plan, optimizer: OptimizerFactory,
                 loss_fn: Callable | None = None, measure_activations: bool = False) -> None:
        refuse_unbuilt(plan)
        self.plan = plan
        self.mesh = Mesh.build(plan)
        self.comm = Comm(self.mesh)
        self.model = model.to(self.mesh.device)
        if loss_fn is None and not hasattr(model, "loss"):
            raise TypeError(f"{type(model).__name__} has no .loss(output, targets): pass "
                            "loss_fn=, e.g. torch.nn.functional.cross_entropy")
        self.loss_fn = loss_fn or model.loss
        # DDP before the optimizer: the optimizer must see the gradients DDP owns.
        self.data_parallel = DDP(self.model, self.comm, bucket_mb=plan.bucket_mb)
        self.optimizer = optimizer(list(self.model.parameters()))
        self.activations = ActivationMeter(self.model.parameters()) if measure_activations else None
        self.steps_done = 0

    # ---- who am I -----------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.axis_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh.size("dp")

    # ---- training -----------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's shard of the global batch.

        The shard is split into `plan.microbatches` micro-batches whose gradients accumulate
        without communication until the last. Returns the global mean loss (same on all ranks).
        """
        micro_inputs = split_microbatches(inputs, self.plan.microbatches)
        micro_targets = split_microbatches(targets, self.plan.microbatches)
        ddp = self.data_parallel
        ddp.zero_grad()
        loss_sum = torch.zeros((), device=self.mesh.device)
        last = len(micro_inputs) - 1
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            x, y = x.to(self.mesh.device), y.to(self.mesh.device)
            with (ddp.no_sync() if i < last else nullcontext()):
                loss = self._forward_loss(x, y) / len(micro_inputs)
                loss.backward()
            loss_sum += loss.detach()
        mean_loss = ddp.finish_gradient_sync(loss_sum)
        self.optimizer.step()
        self.steps_done += 1
        return mean_loss

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.activations is None:
            return self.loss_fn(self.model(x), y)
        with self.activations.measure():
            return self.loss_fn(self.model(x), y)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over `batches` (the same on every rank; no gradient, no communication)."""
        self.model.eval()
        try:
            losses = [float(self.loss_fn(self.model(x.to(self.mesh.device)),
                                         y.to(self.mesh.device))) for x, y in batches]
        finally:
            self.model.train()
        return sum(losses) / max(1, len(losses))

    # ---- state --------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated model state with the model's own key names (as model.state_dict())."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, path, extra: dict | None = None) -> None:
        """Sharded checkpoint (torch.distributed.checkpoint), written atomically."""
        checkpoint.save(path, self.model, self.optimizer, self.plan,
                        dict(extra or {}, steps_done=self.steps_done))

    def load(self, path) -> dict:
        """Restore model and optimizer from `path` (saved under any plan); returns its extras."""
        extra = checkpoint.load(path, self.model, self.optimizer)
        self.steps_done = int(extra.get("steps_done", 0))
        self.data_parallel.zero_grad()  # loading touched .grad: start the next step clean
        return extra

    def memory_report(self) -> MemoryReport:
        return MemoryReport(
            parameters=storage_bytes(self.model.parameters()),
            gradients=self.data_parallel.gradient_bytes,
            optimizer_states=storage_bytes(optimizer_state_tensors(self.optimizer)),
            activations=self.activations.last_bytes if self.activations else None,
            peak_process=peak_process_bytes())


def split_microbatches(batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """Split along dim 0 into equal micro-batches; refuse a split that is not exact."""
    if batch.shape[0] % microbatches:
        raise PlanError(f"this rank's batch of {batch.shape[0]} does not split into "
                        f"microbatches={microbatches}; use a per-rank batch that is a multiple "
                        f"of {microbatches}")
    return list(batch.chunk(microbatches))
