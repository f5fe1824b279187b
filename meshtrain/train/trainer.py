"""The Trainer: builds the strategy stack a Plan describes and runs training steps.

    trainer = Trainer(model, Plan(dp=2), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    loss = trainer.step(inputs, targets)   # this rank's dp shard; returns the global mean loss

The model goes through five slots in a fixed order (strategies/slots.py), each a plain
function of the plan; the Trainer only sequences them, so every plan, 3D included, is the
same five calls with different choices. A Plan asking for a strategy not built yet is refused
by name before anything is built.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from meshtrain.core.admit import check_plan
from meshtrain.core.comm import Comm
from meshtrain.core.watchdog import CollectiveFailure, is_communication_error, watch
from meshtrain.core.device import device_capability, device_memory
from meshtrain.core.loss_chunks import uses_lean_loss
from meshtrain.core.memory import (ActivationMeter, MemoryReport, optimizer_state_tensors,
                                   peak_process_bytes, reset_process_peak, resident_bytes,
                                   storage_bytes)
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import Plan
from meshtrain.core.processes import steady_host_heap
from meshtrain.models import experts, hf, moe
from meshtrain.models.lean_cross_entropy import lean_cross_entropy
from meshtrain.models.registry import logits_of
from meshtrain.strategies import pipeline
from meshtrain.strategies.compile import apply_compile, compiled_token_loss
from meshtrain.strategies.materialise import init_source, materialise
from meshtrain.strategies.float8 import check_fp8, convert_to_fp8
from meshtrain.strategies.recompute import apply_recompute
from meshtrain.strategies.tensor_parallel.sharding import is_token_cross_entropy
from meshtrain.train import checkpoint, checkpoint_shares, resume
from meshtrain.train.checkpoint_shares import param_shaped
from meshtrain.train.slots import (check_layer_sharding, drive_steps, keep_stages, routing_sums,
                                   shard_layers, split_context, sync_gradients)
from meshtrain.core.state import StateLayout

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Trainer:
    def __init__(self, model: nn.Module, plan: Plan, optimizer: OptimizerFactory,
                 loss_fn: Callable | None = None) -> None:
        """Everything that shapes the run is in `plan` (saved and compared whole); the
        optimizer and the loss are code. `loss_fn` None: the model's own .loss."""
        check_plan(plan, model)   # the world size: Mesh.build, after the model's refusals
        moe.check(model, plan)
        self.runtime_bytes = resident_bytes()   # before this rank holds any of the model
        reset_process_peak()
        # a transformers causal LM brings its own loss and tp plan (models/hf.py): model
        # defaults, filled where the plan leaves them unset
        loss_fn, tp_plan = hf.defaults(model, plan.tp, loss_fn,
                                       dict(plan.tp_plan) if plan.tp_plan else None)
        if loss_fn is None and not hasattr(model, "loss"):
            raise TypeError(f"{type(model).__name__} has no .loss(output, targets): pass "
                            "loss_fn=, e.g. torch.nn.functional.cross_entropy")
        check_layer_sharding(model, plan, tp_plan)
        pipeline.check(model, plan, _list(plan.stage_cuts))   # layers: before any group
        self.plan, self.max_grad_norm = plan, plan.max_grad_norm
        self.mesh = Mesh.build(plan)
        if self.mesh.device.type == "cpu" and (plan.zero == 3 or plan.offload != "none"):
            steady_host_heap()   # a plan chosen for memory: the peak near what is held
        self.comm = Comm(self.mesh)
        self.watchdog = watch(self.comm)   # names the culprit when a collective fails
        # a model on the meta device is made real only where it is kept, after slots 1-2
        source = init_source(model)
        self.model = model if source is not None else model.to(self.mesh.device)
        self.loss_fn = loss_fn or model.loss
        if uses_lean_loss(plan.recompute, plan.tp) and is_token_cross_entropy(self.loss_fn):
            # recomputed layers keep little; the loss's fp32 copies would then dominate
            self.loss_fn = _lean_token_loss   # in fp32 too, without keeping them
        elif plan.compile_backend and plan.tp == 1 and is_token_cross_entropy(self.loss_fn):
            # in fp32, the upcast and the softmax fused
            self.loss_fn = compiled_token_loss(plan.compile_backend, plan.compile_mode)
        elif plan.precision != "fp32":   # the loss in fp32 whatever the compute precision
            self.loss_fn = _loss_in_fp32(self.loss_fn)
        # a mixture of experts' router loss over the global batch's routing (models/moe.py)
        self.router_loss = moe.router_loss(model, self.loss_fn, *routing_sums(self.comm))
        self.loss_fn = self.router_loss or self.loss_fn
        self.last_loss_parts: dict[str, float] | None = None   # the last step's, by name
        self.layout = StateLayout.of(self.model)   # names and shapes, before any slot
        # 1. tensor parallel first: stages and gradient sync then see the shards
        self.sharding = shard_layers(self.model, plan, self.comm, tp_plan)
        self.capacity = experts.limit_capacity(self.model, plan.capacity_factor)   # after ep
        self.loss_fn = self.sharding.wrap_loss(self.loss_fn)   # vocab-parallel where split
        self.context = split_context(self.model, plan, self.comm)   # each cp rank its chunks
        self.activations = (ActivationMeter(self.model.parameters())
                            if plan.measure_activations else None)
        # float8 after tp (its split linears: a float8 product), before compile and recompute
        check_fp8(plan.precision, plan.fp8_emulate, self.mesh.device.type,
                  *device_capability(self.mesh.device))
        self.float8 = (convert_to_fp8(self.model, plan.fp8_recipe, plan.fp8_emulate, self.comm)
                       if plan.precision == "fp8" else [])
        # compiled blocks after tensor parallel (they trace the sharded layers) and before
        # recomputation, whose checkpoint then wraps the compiled forward (strategies/compile.py)
        self.compiled = apply_compile(self.model, plan.compile_backend, plan.compile_mode)
        # recomputation after tensor parallel, before stages and data parallel (torchtitan's
        # order): it wraps the layers as they will run
        self.recomputed = apply_recompute(self.model, plan.recompute,
                                          self.activations.keep if self.activations else None,
                                          plan.recompute_every)
        # 2. pipeline stages: the data-parallel sync covers only what this stage keeps
        self.stages = keep_stages(self.model, plan, self.comm, self.layout)
        if self.activations is not None:
            self.activations.track(p for _, p in self.stages.named_parameters())
        # 3-4. gradient sync before the optimizer: the optimizer must see what the sync owns
        fill = None if source is None else functools.partial(
            materialise, self.model, self.stages.modules(), self.layout, self.sharding, source,
            self.mesh.device)
        self.data_parallel = sync_gradients(self.stages, plan, self.comm, fill,
                                            self.sharding.replicas)
        self.optimizer = self.data_parallel.build_optimizer(optimizer)
        # 5. the step driver
        self.driver = drive_steps(self.model, self.stages, plan, self.comm, self.loss_fn,
                                  self.activations, self.data_parallel)
        self._held = {name for name, _ in self.stages.named_parameters()}   # this rank's
        self.build_peak = peak_process_bytes()   # the training peak is told apart from it
        self.train_peak = self.checkpoint_peak = self.checkpoint_share = self.steps_done = 0
        self.checkpoint_read = 0   # tensor bytes the last load read (train/resume.py)
        reset_process_peak()
        self._grad_norm: torch.Tensor | None = None   # read by `last_grad_norm`

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

        The shard is split into `plan.microbatches` micro-batches; their gradients are
        synchronised over dp once, and the returned loss is the global mean (the same on
        every rank; under diloco / local-sgd between syncs, this worker's own). A collective
        that times out or loses a peer raises CollectiveFailure naming the rank behind,
        diverged or gone, and the call."""
        with self._watched():
            return self._step(inputs, targets)

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        sync = self.data_parallel
        sync.zero_grad()
        split = self.context.split
        local_loss = self.driver.run(split(inputs), split(targets), sync)
        loss = self.driver.global_loss(sync.finish_gradient_sync(local_loss))
        if self.router_loss is not None:
            self.last_loss_parts = self._loss_parts()
        self._sum_gradients_across_axes()
        if self.max_grad_norm is not None:
            self._grad_norm = self._clip(self.max_grad_norm)
        sync.step()
        self.steps_done += 1
        return loss

    def _loss_parts(self) -> dict[str, float]:
        """The step's loss in its parts, global means: the loss function's (cross-entropy)
        and the router's load-balancing loss unscaled (loss = cross_entropy + coef x it)."""
        parts = self.router_loss.take_parts()   # None on a pp stage before the last
        if parts is None:
            parts = torch.zeros(2, device=self.mesh.device)
        axis = self.mesh.replica_axis   # dp (x cp)
        self.comm.all_reduce(parts, axis, tag="loss-parts")
        parts /= self.mesh.size(axis)
        if self.plan.pp > 1:   # only the last stage computed them
            self.comm.broadcast(parts, self.plan.pp - 1, "pp", tag="loss-parts")
        return {"cross_entropy": parts[0].item(), "router_aux": parts[1].item()}

    def _settle(self) -> None:
        """Let a gradient sync with messages in flight (ps-async) finish them before a
        collective that every rank enters at the same step."""
        self.data_parallel.settle()

    def pause(self, seconds: float) -> None:
        """Delay this rank (the straggler experiment), still serving whatever it hosts."""
        self.data_parallel.idle(seconds)

    def _sum_gradients_across_axes(self) -> None:
        """Gradients the dp sync leaves partial along another axis: a weight tied across
        pipeline stages (summed over the stages holding it), a LayerNorm under sequence
        parallel (summed over tp)."""
        held = self._held

        def reduced(name: str):   # None for what another pipeline stage holds
            return self.data_parallel.reduced_gradient(name) if name in held else None
        self.stages.sum_shared_gradients(reduced)
        self.sharding.sum_partial_gradients(reduced)

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before the last step's clipping (None without
        max_grad_norm): read from the device when asked, not by the step."""
        return None if self._grad_norm is None else self._grad_norm.item()

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients so that their global norm (over every axis) is at most
        `max_norm`, as torch.nn.utils.clip_grad_norm_ does in one process; returns the norm."""
        return self._clip(max_norm).item()

    def _clip(self, max_norm: float) -> torch.Tensor:
        """`clip_gradients` without reading the norm on the host (the step never waits)."""
        counted = lambda name: self.sharding.counts(name) and self.stages.counts(name)
        square_sum = self.data_parallel.gradient_square_sum(counted)
        for axis in ("tp", "pp", self.mesh.replica_axis):
            self.comm.all_reduce(square_sum, axis, tag="grad-norm")
        norm = square_sum.sqrt().float()
        self.data_parallel.scale_gradients(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over `batches`, the same on every rank, no gradient. The data-parallel
        replicas split the batches between them (replica r takes every dp_size-th from r)
        and sum their losses in float64."""
        with self._watched():
            return self._evaluate(list(batches))

    def _evaluate(self, batches: list) -> float:
        self._settle()
        mine = batches[self.dp_rank::self.dp_size]
        # a forward that gathers over dp (ZeRO-3) or exchanges tokens (expert parallel) must
        # run as often on every dp rank: a rank short of batches runs the first one again,
        # uncounted
        collective = self.data_parallel.forward_gathers or self.plan.ep > 1
        rounds = -(-len(batches) // self.dp_size) if collective else 0
        self.model.eval()
        try:
            split = self.context.split   # each cp rank's loss: its equal share's mean
            losses = [self.driver.evaluate(split(x), split(y)) for x, y in mine]
            for _ in range(rounds - len(mine)):
                self.driver.evaluate(split(batches[0][0]), split(batches[0][1]))
        finally:
            self.model.train()
        total = torch.tensor([sum(losses), len(mine)], dtype=torch.float64,
                             device=self.mesh.device)
        self.comm.all_reduce(total, self.mesh.replica_axis, tag="eval")
        return (total[0] / total[1].clamp(min=1)).item()

    @contextmanager
    def _watched(self):
        if self.watchdog is not None:   # a stall counts only inside a step (NCCL's case)
            self.watchdog.follow(self.comm)   # this Trainer's calls, not the newest one's
            self.watchdog.busy = True
        try:
            yield
        except RuntimeError as exc:
            if self.watchdog is None or not is_communication_error(exc):
                raise
            raise CollectiveFailure(self.watchdog.diagnose(exc)) from exc
        finally:
            if self.watchdog is not None:
                self.watchdog.busy = False

    # ---- state --------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated model state with the model's own key names (as model.state_dict()).
        Collective: every rank calls it, and every rank gets the whole state."""
        local = dict(self.data_parallel.local_parameters())
        local.update({n: b.detach() for n, b in self.stages.named_buffers()})
        full = {n: self.sharding.full(n, t).clone() for n, t in local.items()}
        return self.layout.expand(self.stages.merge(full))

    def full_optimizer_state(self) -> dict:
        """The optimizer's state as one process would hold it, keyed by parameter name:
        {"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}.
        Collective."""
        state, groups = self.data_parallel.local_optimizer_state()
        full = {name: {k: self.sharding.full(name, v) if param_shaped(v) else v
                       for k, v in per_param.items()}
                for name, per_param in state.items()}
        return {"state": self.stages.merge(full), "param_groups": groups}

    def load_full_state(self, model_state: dict[str, torch.Tensor],
                        optimizer_state: dict | None, saved_mode: str | None = None) -> None:
        """Take this rank's part of a consolidated state (as `full_state_dict` and
        `full_optimizer_state` give it, under the dp_mode `saved_mode`); no communication."""
        params = {n: self.sharding.local(n, model_state[n])
                  for n, _ in self.stages.named_parameters()}
        if optimizer_state is not None:
            optimizer_state = dict(optimizer_state, state={
                n: {k: self.sharding.local(n, v) if param_shaped(v) else v
                    for k, v in s.items()}
                for n, s in optimizer_state["state"].items() if n in params})
        resume.take_local_state(self, params, model_state, optimizer_state, saved_mode)

    def save(self, path, extra: dict | None = None) -> None:
        """Checkpoint (torch.distributed.checkpoint) of the consolidated state, written
        atomically; loadable under any plan, except a DiLoCo / local SGD checkpoint taken
        mid-round under a plan keeping one replica (refused by name). No rank holds the
        whole state: each rank of a stage takes its rows of every tensor (under ZeRO
        straight from the shards, else from a group consolidated at a time) and writes
        that even share from host memory ([Note: even shares] in train/checkpoint_shares.py)."""
        self.train_peak = max(self.train_peak, peak_process_bytes())   # the steps' so far
        reset_process_peak()
        share = checkpoint_shares.share_of_state(self)
        self.checkpoint_share = max(self.checkpoint_share, share.bytes())
        stepped = torch.tensor([float(len(share.states))], device=self.mesh.device)
        for axis in ("tp", "pp", self.mesh.replica_axis):
            self.comm.all_reduce(stepped, axis, tag="save")
        optimizer_state = ({"state": share.states,
                            "param_groups": self.data_parallel.optimizer_groups()}
                           if stepped.item() else None)
        checkpoint.save(path, share.model_state, optimizer_state, self.plan,
                        dict(extra or {}, steps_done=self.steps_done), shapes=self.layout.shapes,
                        cuts_of=resume.cuts_of(self), placed=share.placed)
        self.checkpoint_peak = max(self.checkpoint_peak, peak_process_bytes())
        reset_process_peak()   # what follows is training again

    def load(self, path) -> dict:
        """Restore model and optimizer from `path` (saved under any plan); returns its extras."""
        extra = resume.load(self, path)   # this rank's regions alone: train/resume.py
        self.steps_done = int(extra.get("steps_done", 0))
        self.data_parallel.resume_at(self.steps_done)
        return extra

    def close(self) -> None:
        """Release what outlives the trainer otherwise (offload's files on disk)."""
        self.data_parallel.close()

    def memory_report(self) -> MemoryReport:
        return MemoryReport(
            **self.data_parallel.memory(),
            activations=self.activations.last_bytes if self.activations else None,
            peak_process=max(self.train_peak, peak_process_bytes()),
            host_pinned=storage_bytes(self.data_parallel.pinned_buffers()),   # offload's
            optimizer_on_host=self._optimizer_on_host(),
            build_peak=self.build_peak, runtime=self.runtime_bytes, staging=self.comm.staging.peak,
            checkpoint_peak=self.checkpoint_peak or None, checkpoint_share=self.checkpoint_share,
            **(device_memory(self.mesh.device) or {}))

    def _optimizer_on_host(self) -> int:
        """Bytes of the optimizer's tensors (its states, the masters it steps) in host
        memory on a GPU rank: what offload='cpu' keeps off the GPU (not the step counters
        PyTorch's optimizers keep on the host anyway)."""
        if self.mesh.device.type != "cuda":
            return 0
        held = optimizer_state_tensors(self.optimizer) + [
            p for group in self.optimizer.param_groups for p in group["params"]]
        return storage_bytes(t for t in held if t.device.type == "cpu" and t.dim() > 0)


def _lean_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return lean_cross_entropy(logits_of(output), targets)


def _loss_in_fp32(loss_fn: Callable) -> Callable:
    def loss(output, targets):
        return loss_fn(logits_of(output).float(), targets)   # any output type
    return loss


def _list(values) -> list | None:
    return None if values is None else list(values)
