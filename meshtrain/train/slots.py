"""The five slots, each a plain function of the plan, in the order the Trainer fills them
(strategies/slots.py holds their protocols; ARCHITECTURE.md draws them)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import ActivationMeter
from meshtrain.core.plan import LOCAL_STEP_MODES, Plan
from meshtrain.core.state import StateLayout
from meshtrain.models.experts import check_capacity
from meshtrain.strategies import context_parallel, expert_parallel, pipeline, tensor_parallel
from meshtrain.strategies.compile import graph_step_marker
from meshtrain.strategies.data_parallel.ddp import DDP
from meshtrain.strategies.data_parallel.diloco import DiLoCo
from meshtrain.strategies.data_parallel.master_dp import MasterDP
from meshtrain.strategies.data_parallel.parameter_server import ParameterServer
from meshtrain.strategies.data_parallel.powersgd import PowerSGD
from meshtrain.strategies.data_parallel.ps_async import AsyncParameterServer
from meshtrain.strategies.slots import (GradientSync, LayerSharding, MicrobatchLoop, NoSharding,
                                        Stages, StepDriver, WholeModel, WholeSequences)
from meshtrain.strategies.shared.replicas import ReplicaGroup
from meshtrain.strategies.zero.sharded import ZeRO
from meshtrain.strategies.zero.zero3 import ZeRO3


def shard_layers(model: nn.Module, plan: Plan, comm: Comm, tp_plan: dict | None) -> LayerSharding:
    """Slot 1: shard each layer's matrices over tp, in place, keeping parameter names."""
    check_layer_sharding(model, plan, tp_plan)
    sharding = NoSharding() if plan.tp == 1 else tensor_parallel.shard(model, plan, comm, tp_plan)
    if plan.ep > 1:   # then a MoE's experts (whole over tp) over ep ranks
        sharding = expert_parallel.shard(model, plan, comm, sharding)
    return sharding


def check_layer_sharding(model: nn.Module, plan: Plan, tp_plan: dict | None) -> None:
    """Slot 1's refusals that need the model's modules but no process group (run before
    the mesh is built; check_plan has refused a tp_plan without tp)."""
    tensor_parallel.check(model, plan, tp_plan)
    expert_parallel.check(model, plan)
    check_capacity(model, plan)   # installed by the Trainer after ep (models/experts.py)
    context_parallel.check(model, plan)


def split_context(model: nn.Module, plan: Plan, comm: Comm):
    """Slot 1 over cp: attention across the cp ranks, and the split that gives each its
    chunks of every sequence (strategies/context_parallel)."""
    if plan.cp == 1:
        return WholeSequences()
    return context_parallel.apply(model, plan, comm)


def routing_sums(comm: Comm) -> tuple[Callable, Callable | None]:
    """How a mixture of experts' routing counts are summed (models/moe.py): in training
    over every rank of the global batch, dp x cp (each cp rank routes its chunks of each
    sequence); in evaluation, where each dp rank has whole batches, over the cp ranks
    sharing its sequences (none where cp = 1)."""
    mesh = comm.mesh

    def over_batch(t):
        comm.all_reduce(t, mesh.replica_axis, tag="router-counts")

    def over_chunks(t):
        comm.all_reduce(t, "cp", tag="router-counts-eval")
    return over_batch, (over_chunks if mesh.size("cp") > 1 else None)


def keep_stages(model: nn.Module, plan: Plan, comm: Comm, layout: StateLayout) -> Stages:
    """Slot 2: keep only this rank's pipeline stages (chunks) of the model."""
    if plan.pp == 1:
        return WholeModel(model, layout.canonical)
    return pipeline.keep_stages(model, plan, comm, layout, _list(plan.stage_cuts))


def sync_gradients(stages: Stages, plan: Plan, comm: Comm,
                   fill: Callable | None = None,
                   replicas: dict[str, ReplicaGroup] | None = None) -> GradientSync:
    """Slots 3 and 4: how dp replicas agree on gradients, and who owns the optimizer.
    Parameters in `stages.shared` must be laid out identically on every stage holding them.
    `fill(take_parameter)` makes a model on the meta device real (strategies/materialise.py):
    before the sync is built, or, under ZeRO-3, straight into its shards. `replicas`: the
    parameters slot 1 left replicated over fewer ranks than dp (LayerSharding.replicas)."""
    zero3 = plan.zero == 3 and plan.dp_mode == "ddp"
    if fill is not None and not zero3:
        fill(None)
    params, buffers = stages.named_parameters(), [b for _, b in stages.named_buffers()]
    axis = comm.mesh.replica_axis   # dp, or dp x cp (core/mesh.py [Note: the replica axis])
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
                     unit_names=_list(plan.zero3_units), axis=axis,
                     offload_dir=plan.offload_dir, fill=fill, replicas=replicas,
                     entries=stages.modules(), shared=list(stages.shared))
    if plan.zero in (1, 2):
        return ZeRO(params, buffers, comm, plan, shared=list(stages.shared), axis=axis,
                    offload_dir=plan.offload_dir, replicas=replicas, chunks=stages.modules())
    if plan.compression == "powersgd":
        return PowerSGD(params, buffers, comm, plan.bucket_mb, plan.compression_rank,
                        plan.compression_min_rate, plan.sync_warmup_steps)
    return DDP(params, buffers, comm, bucket_mb=plan.bucket_mb, precision=plan.precision,
               axis=axis, replicas=replicas, chunks=stages.modules())


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
