"""The five slots, each a plain function of the plan, in the order the Trainer fills them
(strategies/slots.py holds their protocols; ARCHITECTURE.md draws them)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import ActivationMeter
from meshtrain.core.plan import LOCAL_STEP_MODES, Plan
from meshtrain.core.state import StateLayout
from meshtrain.strategies import pipeline, tensor_parallel
from meshtrain.strategies.compile import graph_step_marker
from meshtrain.strategies.data_parallel.ddp import DDP
from meshtrain.strategies.data_parallel.diloco import DiLoCo
from meshtrain.strategies.data_parallel.master_dp import MasterDP
from meshtrain.strategies.data_parallel.parameter_server import ParameterServer
from meshtrain.strategies.data_parallel.powersgd import PowerSGD
from meshtrain.strategies.data_parallel.ps_async import AsyncParameterServer
from meshtrain.strategies.slots import (GradientSync, LayerSharding, MicrobatchLoop, NoSharding,
                                        Stages, StepDriver, WholeModel)
from meshtrain.strategies.zero.sharded import ZeRO
from meshtrain.strategies.zero.zero3 import ZeRO3


def shard_layers(model: nn.Module, plan: Plan, comm: Comm, tp_plan: dict | None) -> LayerSharding:
    """Slot 1: shard each layer's matrices over tp, in place, keeping parameter names."""
    check_layer_sharding(model, plan, tp_plan)
    if plan.tp == 1:
        return NoSharding()
    return tensor_parallel.shard(model, plan, comm, tp_plan)


def check_layer_sharding(model: nn.Module, plan: Plan, tp_plan: dict | None) -> None:
    """Slot 1's refusals that need the model's modules but no process group (run before
    the mesh is built; check_plan has refused a tp_plan without tp)."""
    tensor_parallel.check(model, plan, tp_plan)


def keep_stages(model: nn.Module, plan: Plan, comm: Comm, layout: StateLayout) -> Stages:
    """Slot 2: keep only this rank's pipeline stages (chunks) of the model."""
    if plan.pp == 1:
        return WholeModel(model, layout.canonical)
    return pipeline.keep_stages(model, plan, comm, layout, _list(plan.stage_cuts))


def sync_gradients(stages: Stages, plan: Plan, comm: Comm,
                   fill: Callable | None = None) -> GradientSync:
    """Slots 3 and 4: how dp replicas agree on gradients, and who owns the optimizer.
    Parameters in `stages.shared` must be laid out identically on every stage holding them.
    `fill(take_parameter)` makes a model on the meta device real (strategies/materialise.py):
    before the sync is built, or, under ZeRO-3, straight into its shards."""
    zero3 = plan.zero == 3 and plan.dp_mode == "ddp"
    if fill is not None and not zero3:
        fill(None)
    params, buffers = stages.named_parameters(), [b for _, b in stages.named_buffers()]
    if plan.dp_mode == "dp":
        return MasterDP(stages.model, params, comm, replicas=plan.dp)
    if plan.dp_mode == "ps-sync":
        return ParameterServer(params, buffers, comm, plan)
    if plan.dp_mode == "ps-async":
        return AsyncParameterServer(params, buffers, comm, plan)
    if plan.dp_mode in LOCAL_STEP_MODES:
        return DiLoCo(params, buffers, comm, plan)
    if zero3:
        return ZeRO3(stages.model, params, buffers, comm, plan,
                     unit_names=_list(plan.zero3_units), offload_dir=plan.offload_dir,
                     fill=fill)
    if plan.zero in (1, 2):
        return ZeRO(params, buffers, comm, plan, shared=list(stages.shared),
                    offload_dir=plan.offload_dir)
    if plan.compression == "powersgd":
        return PowerSGD(params, buffers, comm, plan.bucket_mb, plan.compression_rank,
                        plan.compression_min_rate, plan.sync_warmup_steps)
    return DDP(params, buffers, comm, bucket_mb=plan.bucket_mb, precision=plan.precision,
               keep_buckets=plan.pp > 1)   # see [Note: one replica] in ddp.py


def drive_steps(model: nn.Module, stages: Stages, plan: Plan, comm: Comm, loss_fn: Callable,
                activations: ActivationMeter | None, sync: GradientSync) -> StepDriver:
    """Slot 5: the order of forwards, backwards and communication in a step: the gradient
    sync's own where it has one (master DP's replica threads), else by pp."""
    own = sync.step_driver(loss_fn, plan.microbatches, comm.mesh.device)
    if own is not None:
        return own
    if plan.pp > 1:
        return pipeline.PipelineSchedule(stages, plan, comm, loss_fn, activations)
    return MicrobatchLoop(model, loss_fn, plan.microbatches, comm.mesh.device, activations,
                          graph_step_marker(plan.compile_mode))




def _list(values) -> list | None:
    return None if values is None else list(values)
