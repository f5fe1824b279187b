"""Bytes of parameters, gradients and optimizer states per rank for one plan, and the
buffers data parallel moves them through.

Sources, each quoted where its formula is used:
- ZeRO, Rajbhandari et al. 2020 (SC'20), §3.1 and Table 1: model states (2 + 2 + K) Psi bytes
  for mixed-precision Adam, divided by N_d as P_os, P_os+g, P_os+g+p shard them.
- ZeRO-Offload, Ren et al. 2021 (ATC'21) §3-4 and ZeRO-Infinity, Rajbhandari et al. 2021:
  optimizer states and gradients (and, with stage 3, parameters) held in host memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.core.plan import Plan
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import most_blocks, stage_blocks


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optim: float
    host: float = 0.0           # bytes moved to host memory (or disk) by offload

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optim


def model_states(psi: float, setup: Setup, zero: int = 0, dp: int = 1,
                 offload: str = "none", host_is_device: bool = False) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states for `psi` parameters on one rank.

    ZeRO Table 1 / §5: baseline (2 + 2 + K) Psi; P_os 2Psi + 2Psi + K Psi/N_d;
    P_os+g 2Psi + (2 + K) Psi/N_d; P_os+g+p (2 + 2 + K) Psi/N_d.
    Offload (ZeRO-Offload §4.1): optimizer states leave the device; with stage >= 2 the
    gradient shard too; with stage 3 the parameter shard as well (ZeRO-Infinity §5).
    """
    n = dp
    params = psi * setup.param_bytes / (n if zero >= 3 else 1)
    grads = psi * setup.grad_bytes / (n if zero >= 2 else 1)
    optim = psi * setup.optim_bytes / (n if zero >= 1 else 1)
    if offload == "none" or zero == 0 or (host_is_device and offload == "cpu"):
        return ModelStates(params, grads, optim)
    if host_is_device:   # CPU ranks: disk takes the optimizer states (and ZeRO-3's parameter
        # shards); the gradient shard stays in the memory the optimizer step reads it from
        return ModelStates(params if zero < 3 else 0.0, grads, 0.0,
                           optim + (params if zero >= 3 else 0))
    host = optim + (grads if zero >= 2 else 0) + (params if zero >= 3 else 0)
    return ModelStates(params if zero < 3 else 0.0, grads if zero < 2 else 0.0, 0.0, host)


def local_step_states(psi: float, setup: Setup, outer_momentum: bool = True) -> ModelStates:
    """A DiLoCo / local SGD worker (diloco.py): DDP's states, plus parameter-sized fp32
    buffers counted with the optimizer's: the anchor, the pseudo-gradient's all-reduce
    buffer and, where the outer SGD has momentum (DiLoCo; not local SGD), its momentum."""
    base = model_states(psi, setup)
    return ModelStates(base.params, base.grads, base.optim + (2 + outer_momentum) * psi * 4)


def server_states(psi: float, setup: Setup, shards: int, server: bool) -> ModelStates:
    """A parameter server's rank (parameter_server.py): as a worker, the whole model and one
    gradient bucket, no optimizer; a server adds its shard's master copy, the sum of the
    pushes it receives and the optimizer's states for 1/K of the parameters."""
    params, grads, optim = psi * setup.param_bytes, psi * setup.grad_bytes, 0.0
    if server:
        shard = math.ceil(psi / shards)
        params += shard * setup.param_bytes
        grads += shard * setup.grad_bytes
        optim += shard * setup.optim_bytes
    return ModelStates(params, grads, optim)


def master_states(psi: float, setup: Setup, replicas: int) -> ModelStates:
    """DP with a master device (master_dp.py): the one process holds every replica's
    parameters and gradients and the master's optimizer states."""
    return ModelStates(replicas * psi * setup.param_bytes, replicas * psi * setup.grad_bytes,
                       psi * setup.optim_bytes)


def zero_comm_volume(zero: int, psi: float) -> float:
    """Elements each rank sends per step for data-parallel gradients (ZeRO §7.2.1-7.2.2):
    all-reduce 2Psi for DDP, P_os and P_os+g (reduce-scatter Psi + all-gather Psi); 3Psi for
    P_os+g+p (parameters all-gathered in forward and again in backward, gradients
    reduce-scattered): 1.5x DDP."""
    return (3 if zero == 3 else 2) * psi


def stage_params(spec: ModelSpec, plan: Plan, stage: int | None = None) -> float:
    """Parameters on pipeline rank `stage` of `plan` (None: the busiest): its blocks, as
    the pipeline cuts them (planner/stage_split.stage_blocks), plus the embedding on the
    first stage and the head on the last, split t ways except what tensor parallel keeps
    whole on every rank (Megatron: vocab-parallel embedding and column/row-parallel
    matrices are split; the norms, the row-parallel biases and a learned position
    embedding are replicated)."""
    tp = plan.tp
    per_block = spec.layer_params
    if spec.measured_params:   # keep the exact total when it was read from a module
        per_block = (spec.measured_params - spec.embedding_params - spec.head_params) / spec.layers
    whole = spec.layer_replicated_params
    stages = [(n * per_block, n * whole) for n in stage_blocks(spec, plan)]
    first = stages[0]
    stages[0] = (first[0] + spec.embedding_params, first[1] + spec.embedding_replicated_params)
    tied = spec.vocab * spec.hidden if spec.tied and plan.pp > 1 else 0
    stages[-1] = (stages[-1][0] + spec.head_params + tied, stages[-1][1] + spec.norm_params)

    def on_rank(total: float, whole: float) -> float:
        return total if tp == 1 else (total - whole) / tp + whole

    if stage is not None:
        return on_rank(*stages[stage])
    return max(on_rank(*st) for st in stages)


def collective_buffer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The largest buffer one of ZeRO's collectives gathers or scatters: a flat bucket under
    ZeRO-1/2 (the stage's parameters, at most Plan.bucket_mb), a unit under ZeRO-3."""
    p = cand.plan
    if p.zero == 0 or p.dp == 1:
        return 0.0
    if p.zero == 3:
        return gathered_unit_bytes(spec, p, setup)
    return min(stage_params(spec, p) * setup.param_bytes, p.bucket_mb * 2**20)


def staged_buffer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The buffer bytes a CPU backend's staging copies grow with (calibrated per byte):
    ZeRO's largest collective buffer; under ZeRO-3 with full recomputation, once per layer
    of the stage (each layer's re-run forward gathers its unit again amid the recomputed
    activations: measured on meshtrain's GPT, the staging grows with the depth, 2 to 4
    blocks: +30 MB against one buffer's count)."""
    buffer = collective_buffer_bytes(spec, cand, setup)
    if cand.plan.zero == 3 and cand.recompute == "full":
        buffer *= most_blocks(spec, cand.plan)
    return buffer


def largest_layer_bytes(spec: ModelSpec, setup: Setup, tp: int = 1) -> float:
    """A single layer with its gradient and optimizer state: (2 + 2 + K) Psi_layer / t."""
    per_param = setup.param_bytes + setup.grad_bytes + setup.optim_bytes
    return spec.largest_layer_params * per_param / tp


# ---- ZeRO-3's float8 all-gather (strategies/zero/float8_gather.py) ------------------------------
def float8_gathered_params(spec: ModelSpec, plan: Plan, blocks: float) -> float:
    """Elements of `blocks` blocks' weights that ZeRO-3 all-gathers in float8 (`Plan.
    float8_gather`), 1 byte each where bf16 takes 2: torchao's float8 linears, the
    attention's q, k, v, o and a dense MLP's matrices (a mixture's experts are no linears;
    under tp the split linears gather in bf16: none)."""
    if not plan.float8_gather or plan.tp > 1:
        return 0.0
    h = spec.hidden
    mlp = 0 if spec.experts else spec.mlp_matrices * h * spec.ffn_hidden
    return blocks * (2 * h * h + 2 * h * spec.kv_dim + mlp)


def zero3_gathered_bytes(spec: ModelSpec, plan: Plan, setup: Setup, psi: float,
                         stage: int | None = None) -> float:
    """One all-gather of pipeline rank `stage`'s `psi` parameters (None: the busiest
    rank's), in bytes: the float8 weights at 1 byte, the rest at setup.param_bytes."""
    if stage is None:
        stage = max(range(plan.pp), key=lambda s: stage_params(spec, plan, s))
    float8 = float8_gathered_params(spec, plan, stage_blocks(spec, plan)[stage])
    return psi * setup.param_bytes - float8 * (setup.param_bytes - 1)


def gathered_unit_bytes(spec: ModelSpec, plan: Plan, setup: Setup) -> float:
    """The largest ZeRO-3 unit as gathered, in bytes: a block with its float8 weights at 1
    byte under the float8 all-gather, else the largest layer at setup.param_bytes (an
    embedding or a head larger than the block stays whole)."""
    unit = spec.largest_layer_params / plan.tp * setup.param_bytes
    float8 = float8_gathered_params(spec, plan, 1)
    other = max(spec.embedding_params, spec.head_params) / plan.tp * setup.param_bytes
    return max(unit - float8 * (setup.param_bytes - 1), min(other, unit))
