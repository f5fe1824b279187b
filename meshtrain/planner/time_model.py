"""Step time for one candidate plan: compute, communication per mesh axis, pipeline bubble.

Sources, quoted where used:
- Megatron 2021 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21), §5.1 FLOPs per step and §2.2 pipeline bubble.
- Megatron 2019 (Shoeybi et al.) §3: tensor parallel MLP and attention, two all-reduces in
  forward and two in backward per layer; Korthikanti et al. 2022 §4.2.2: sequence parallel
  replaces each all-reduce with reduce-scatter + all-gather of the same volume.
- Ring collectives (Thakur et al. 2005): all-reduce 2(N-1)/N S, reduce-scatter / all-gather
  (N-1)/N S per rank. ZeRO §7 for the data-parallel volumes.
Mesh layout is ("pp", "dp", "tp") with tp fastest-varying (ARCHITECTURE.md): a tp group spans
tp consecutive ranks, a dp group tp*dp, a pipeline boundary tp*dp*pp.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshtrain.core.plan import DDP_FIRST_BUCKET_MB, LOCAL_STEP_MODES
from meshtrain.planner import context_parallel, experts
from meshtrain.planner.compression import powersgd_traffic
from meshtrain.planner.compute_time import dispatch_time, float8_amax_time, micro_batch_compute
from meshtrain.planner.hardware import Cluster, nearest
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import most_blocks, stage_blocks
from meshtrain.planner.states import (gathered_unit_bytes, model_states, stage_params,
                                      zero3_gathered_bytes)


@dataclass(frozen=True)
class StepTime:
    compute: float          # seconds of arithmetic on the busiest rank, bubble excluded
    bubble: float           # seconds idle in the pipeline fill and drain
    tp_comm: float          # tensor-parallel collectives (on the critical path)
    pp_comm: float          # pipeline sends/receives (on the critical path)
    dp_comm: float          # data-parallel gradient/parameter traffic, all of it
    dp_exposed: float       # the part of dp_comm not hidden behind compute
    offload: float          # host transfers and the host optimizer step
    optimizer: float        # the on-device optimizer step
    total: float
    cp_comm: float = 0.0    # context parallel's exchange not hidden behind attention
    ep_comm: float = 0.0    # expert parallel's all-to-alls and the busiest rank's skew

    def to_dict(self) -> dict:
        return asdict(self)


def pipeline_slots(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Time slots (each one micro-batch's forward + backward on one stage) a step takes.

    Megatron 2021 §2.2: GPipe and 1F1B take m + p - 1 slots (bubble fraction (p-1)/m);
    interleaved with v chunks per rank shrinks the bubble to (p-1)/v slots. Naive model
    parallel (no micro-batch overlap) runs the m micro-batches through all p stages in turn.
    """
    if pp == 1:
        return m
    if schedule == "naive":
        return m * pp
    if schedule == "interleaved":
        return m + (pp - 1) / v
    if schedule == "zb-h1":   # the bubble's W filled: (P-1)(F+B-W), a third with F = B = W
        return m + (pp - 1) / 3
    return m + pp - 1


def bucket_sizes(total: float, bucket: float) -> tuple[int, float, float]:
    """DDP buckets of `total` gradient bytes: (count of full buckets, their size, the last
    bucket's size; 0 when none). Buckets close at parameter boundaries; ignoring that is a
    small error."""
    full, rest = (int(total // bucket), total % bucket) if total > 0 else (0, 0.0)
    return (full - 1, float(bucket), float(bucket)) if full and not rest else (
        full, float(bucket), rest)


def tp_overhead(cluster: Cluster, tp: int, hidden: int) -> float:
    """The calibrated unsplit work per block and token at width `tp` (the nearest width
    calibrated when this one was not; 0 when none was), for a model `hidden` wide: the
    norms, residuals and copies it stands for each touch every channel, so it scales with
    the width from the calibrated model's."""
    per_token = nearest(cluster.tp_overhead, tp)
    return per_token * hidden / cluster.tp_overhead_hidden if cluster.tp_overhead_hidden \
        else per_token


def family_exchange(psi: float, setup: Setup, plan, cluster: Cluster) -> float:
    """Seconds a step's gradient exchange takes on the busiest rank of the parameter server
    or DP (data_parallel_family.py): a server receives N-1 pushes of its 1/K shard one after
    another and sends as many pulls back; DP's master copies the parameters out to N-1
    replicas and adds their gradients in, at memory speed."""
    n = plan.dp
    if plan.dp_mode == "dp":
        return (n - 1) * psi * (setup.param_bytes + 2 * setup.grad_bytes) / cluster.mem_bw
    shard = math.ceil(psi / plan.ps_shards)
    p2p = lambda nbytes: cluster.collective_time("p2p", nbytes, 2, n)
    return (n - 1) * (p2p(shard * setup.grad_bytes) + p2p(shard * setup.param_bytes))


def step_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster) -> StepTime:
    """One step on the busiest rank: the pipeline's slots of compute and tp/pp communication
    (bubble included), the data-parallel exchange not hidden behind compute, offload, the
    optimizer step and the Trainer's fixed cost per step: added to the rest where the host
    computes (CPU ranks), the host's side of the slower of the two where it dispatches to a
    device that runs behind it (GPU ranks of a local profile: `async_dispatch`). A cp rank
    is priced as its view (context_parallel.rank_view) plus attention's exchange; expert
    parallel adds its all-to-alls, on the critical path. Each pipeline rank's slot is
    priced for the blocks it holds (planner/stage_split.py): the slowest sets the step."""
    slot = max(stage_slots(spec, cand, setup, cluster), key=sum)
    t_mb, t_tp, t_pp, t_cp, t_ep = slot
    spec, cand = context_parallel.rank_view(spec, cand)
    p = cand.plan
    m = p.microbatches
    compute = m * t_mb
    pipeline = pipeline_time(cand, cluster, sum(slot))
    bubble = pipeline - m * sum(slot)
    psi, expert_psi, edp = experts.expert_share(spec, cand, stage_params(spec, p))
    t_dp, last, stats = dp_comm_time(spec, cand, setup, cluster, psi)
    t_off = offload_time(cand, setup, cluster, psi)
    t_opt = optimizer_time(cand, setup, cluster, psi)
    if edp is not None:   # each expert's gradients over its expert-data-parallel group
        t_edp, last_edp, _ = dp_comm_time(spec, edp, setup, cluster, expert_psi)
        t_dp, last = t_dp + t_edp, last + last_edp
        t_off += offload_time(edp, setup, cluster, expert_psi)
        t_opt += optimizer_time(edp, setup, cluster, expert_psi)
    exposed = max(0.0, t_dp - dp_hidden(cand, cluster, t_dp - last, compute, t_mb)) + stats
    device_work = pipeline + exposed + t_off + t_opt
    step_overhead = trainer_costs(cand, cluster)[1]
    if cluster.async_dispatch:
        # the host queues the step ahead of the device: its own work (the Trainer's fixed
        # cost, its work per layer held, each micro-batch's dispatch) sets the step only
        # where it outlasts the device's
        host = step_overhead + max(cluster.layer_step_overhead * n
                                   + m * dispatch_time(spec, cand, cluster, n)
                                   for n in stage_blocks(spec, p))
        total = max(device_work, host)
    else:
        total = device_work + step_overhead
    return StepTime(compute, bubble, m * t_tp, m * t_pp, t_dp, exposed, t_off, t_opt, total,
                    m * t_cp, m * t_ep)


def stage_slots(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster
                ) -> list[tuple[float, float, float, float, float]]:
    """Seconds of one micro-batch on each pipeline rank, as (compute, tp, pp, cp, ep): its
    own blocks (and the embedding, or the head and the loss), their collectives, and the
    boundary's sends."""
    ep_span = cand.plan.ep * cand.plan.cp * cand.plan.tp
    view, vcand = context_parallel.rank_view(spec, cand)
    p = vcand.plan
    b = vcand.micro_batch / p.dp if p.dp_mode == "dp" else vcand.micro_batch
    compute_scale = trainer_costs(vcand, cluster)[0]
    t_pp = pp_comm_time(view, vcand, setup, cluster, b)
    slots = []
    for stage, n in enumerate(stage_blocks(view, p)):
        t_mb = micro_batch_compute(view, vcand, cluster, b, setup.precision, stage) * compute_scale
        if p.tp > 1:   # what tensor parallel does not split (norms, residuals, the vocabulary
            # loss's extra passes), calibrated per token and block
            t_mb += tp_overhead(cluster, p.tp, view.hidden) * b * view.seq * (n + 1)
        slots.append((t_mb, tp_comm_time(view, vcand, setup, cluster, b, n), t_pp,
                      context_parallel.exposed_time(spec, cand, setup, cluster, n),
                      experts.exposed_time(view, vcand, setup, cluster, ep_span, n)))
    return slots


def trainer_costs(cand: Candidate, cluster: Cluster) -> tuple[float, float]:
    """(factor on a micro-batch's compute, fixed seconds per step): the Trainer's step
    against the bare model's (calibrated; 1 and 0 on presets). DP's replicas are threads of
    one process: one process's."""
    if cand.plan.dp_mode == "dp" and cluster.process_trainer:
        return cluster.process_trainer
    return cluster.compute_scale, cluster.step_overhead


def tp_comm_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster,
                 b: float, blocks: int | None = None) -> float:
    """Tensor parallel per micro-batch on a stage of `blocks` blocks (None: the most a stage
    holds): 4 collectives of b s h per layer (2 forward, 2 backward; Megatron 2019 §3), 6
    with full recomputation (its forward runs twice); ring all-reduce volume. Sequence
    parallel adds the 2 all-gathers per layer that rebuild the column layers' inputs in
    backward (Korthikanti 2022 §4.2.2), counted whole: on CPU ranks they do not hide behind
    the matmul they overlap."""
    p = cand.plan
    act = b * spec.seq * spec.hidden * setup.act_bytes
    layers = most_blocks(spec, p) if blocks is None else blocks
    n_tp = (6 if cand.recompute == "full" else 4) * layers
    t_tp = n_tp * cluster.collective_time("all_reduce", act, p.tp, p.tp)
    if cand.sp:
        t_tp += 2 * layers * cluster.collective_time("all_gather", act, p.tp, p.tp)
    t_tp += float8_amax_time(spec, cand, cluster, layers, b)
    if p.pp > 1:   # beside the other stages' work (calibrated on CPU ranks; 1 on presets)
        t_tp *= cluster.pp_tp_scale
    return t_tp


def pp_comm_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster,
                 b: float) -> float:
    """Pipeline per micro-batch: it sends b s h forward and its gradient back across a
    boundary; with tp > 1 every tp rank sends the whole activation to its peer in the next
    stage (meshtrain's runtime; Megatron 2021 §4.1 would send 1/t and all-gather it)."""
    p = cand.plan
    if p.pp == 1:
        return 0.0
    act = b * spec.seq * spec.hidden * setup.act_bytes
    t_pp = 2 * cluster.collective_time("p2p", act, 2, p.tp * p.dp * p.pp)
    # interleaving multiplies the boundaries crossed (§2.2.2), and the runtime's work
    # per chunk a micro-batch runs through (calibrated on CPU ranks; 0 on presets)
    return (t_pp + cluster.pp_overhead) * p.virtual_stages


def pipeline_time(cand: Candidate, cluster: Cluster, slot: float) -> float:
    """Seconds of the step's forwards and backwards, bubble included, each slot one
    micro-batch's compute and tp/pp communication on one stage."""
    p = cand.plan
    m = p.microbatches
    pipeline = pipeline_slots(p.schedule, p.pp, m, p.virtual_stages) * slot
    if cluster.idle_speedup > 1 and p.pp > 1:
        # more ranks than cores: while some stages wait in the fill and drain, the busy ones
        # get their cores; the step is then bound by the work itself, m slots per rank at
        # the shared speed, or by the critical path at the solo speed
        pipeline = max(m * slot, pipeline / cluster.idle_speedup)
    return pipeline


def dp_comm_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster,
                 psi: float) -> tuple[float, float, float]:
    """(all of the data-parallel exchange, its part that waits for backward's end, the
    step's statistics all-reduce) in seconds, for a stage of `psi` parameters.

    ZeRO §7.2, S = this rank's gradients: DDP / ZeRO-1 one all-reduce (or reduce-scatter +
    all-gather) per step; ZeRO-2 reduce-scatters every micro-batch (it keeps only a gradient
    shard) and all-gathers parameters once; ZeRO-3 all-gathers parameters in forward and in
    backward and reduce-scatters gradients, every micro-batch: 1.5x DDP's volume per
    micro-batch (under pipeline stages once a step each: DDP's volume)."""
    p = cand.plan
    m = p.microbatches
    grad_bytes = psi * setup.grad_bytes
    param_bytes = psi * setup.param_bytes
    coll = lambda kind, nbytes: cluster.collective_time(kind, nbytes, p.dp, p.tp * p.dp)
    last_bucket = bucket_sizes(grad_bytes, p.bucket_mb * 2**20)[2]
    # the step's statistics: the loss, and meshtrain's DDP adds a used-flag per parameter
    # tensor (~13 per block)
    stats_bytes = 4 * (1 + 13 * most_blocks(spec, p))
    if p.zero == 0:
        # DDP all-reduces its gradient buckets (filled from the last layer backwards: the
        # first DDP_FIRST_BUCKET_MB, then Plan.bucket_mb each), each at its own size on the
        # measured curve; the statistics ride in the last bucket.
        first = min(DDP_FIRST_BUCKET_MB * 2**20, p.bucket_mb * 2**20, grad_bytes)
        full, size, last_size = bucket_sizes(grad_bytes - first, p.bucket_mb * 2**20)
        early = full * coll("all_reduce", size) + (coll("all_reduce", first) if last_size else 0)
        last = coll("all_reduce", (last_size or first) + stats_bytes)
        t_dp = early + last
    elif p.zero == 1:
        # the same buckets reduce-scattered once per step (overlapped as DDP's), then the
        # updated parameters all-gathered after the optimizer step: nothing left to hide it
        full, size, last_size = bucket_sizes(grad_bytes, p.bucket_mb * 2**20)
        last = coll("reduce_scatter", last_size) + coll("all_gather", param_bytes)
        t_dp = full * coll("reduce_scatter", size) + last
    elif p.zero == 2:
        # the updated parameters' all-gather follows the optimizer step: no backward left
        # to hide it behind (DeepSpeed stage 2 runs it after the step)
        last = coll("reduce_scatter", last_bucket) + coll("all_gather", param_bytes)
        t_dp = m * coll("reduce_scatter", grad_bytes) + coll("all_gather", param_bytes)
    else:   # under stages once a step each (zero3.py, [Note: ZeRO-3 under pipeline stages]);
        # float8 linears' weights gathered at 1 byte (zero/float8_gather.py)
        ag = coll("all_gather", zero3_gathered_bytes(spec, p, setup, psi))
        rs = coll("reduce_scatter", grad_bytes)
        t_dp = ag + rs if p.pp > 1 and not p.zero3_regather else m * (2 * ag + rs)
        unit = gathered_unit_bytes(spec, p, setup)   # exposed: nothing runs
        last = coll("all_gather", unit) + coll("reduce_scatter", last_bucket)   # beside them
    if p.dp_mode.startswith("ps-") or p.dp_mode == "dp":
        t_dp, last = family_exchange(psi, setup, p, cluster), 0.0
    if p.compression == "powersgd" and p.dp > 1:
        # two all-reduces once backward has ended (P needs the whole gradient): every P
        # with what travels whole and the statistics, then every Q; none hides. The
        # factors' matmuls and QR (about 4 M N r FLOPs a matrix) are left out
        t = powersgd_traffic(spec, p.compression_rank, p.compression_min_rate)
        t_dp = (coll("all_reduce", (t.whole + t.p) * setup.grad_bytes + stats_bytes)
                + coll("all_reduce", t.q * setup.grad_bytes))
        return t_dp, t_dp, 0.0
    if p.dp_mode in LOCAL_STEP_MODES:   # one parameter all-reduce every H steps (DiLoCo
        # §2), amortised per step, latency included; the sync step's loss all-reduce too
        t_dp, last = coll("all_reduce", param_bytes) / p.sync_every, 0.0
        return t_dp, last, coll("all_reduce", 4) / p.sync_every
    stats = 0.0
    if p.dp > 1 and (p.zero >= 1 or p.dp_mode.startswith("ps-")):
        stats = coll("all_reduce", stats_bytes)   # one small all-reduce behind the gradients
    return t_dp, last, stats


def dp_hidden(cand: Candidate, cluster: Cluster, hideable: float, compute: float,
              t_mb: float) -> float:
    """Seconds of the data-parallel exchange hidden behind compute, of the `hideable` part
    (all but what waits for backward's end).

    DDP buckets overlap the all-reduce with the last micro-batch's backward (2/3 of its
    compute; Li et al. 2020, PyTorch DDP §3.2.3), ZeRO-2 its reduce-scatters with every
    micro-batch's backward, except the last bucket, which is ready only when backward ends;
    ZeRO-3 prefetches, hiding its traffic behind all compute (Rajbhandari et al. 2020
    §7.2.2), under stages too when it regathers per micro-batch; else with pp > 1 the exchange
    waits for the pipeline flush (Megatron 2021 §2.2), not hidden. `cluster.overlap` scales
    what can hide: 1 on GPUs (copy engines and NCCL's own SMs); on CPU ranks gloo's threads
    take the cores backward runs on, so a local profile sets it low (see profile.py)."""
    p = cand.plan
    if p.dp == 1 or p.dp_mode != "ddp" or (p.pp > 1 and not p.zero3_regather):
        return 0.0   # pushes and copies start when backward ends
    if p.zero == 3:
        return max(0.0, min(hideable, compute)) * cluster.overlap
    if p.zero == 2:  # the last micro-batch's last bucket, too, waits for backward's end
        return max(0.0, min(hideable, compute * 2 / 3)) * cluster.overlap
    return max(0.0, min(hideable, t_mb * 2 / 3)) * cluster.overlap


def offload_time(cand: Candidate, setup: Setup, cluster: Cluster, psi: float) -> float:
    """Offload (ZeRO-Offload §4): gradient shard to host, updated parameters back, over the
    host link, and Adam on the host CPUs at host_update_rate shared by the node's GPUs."""
    p = cand.plan
    if p.offload == "none":
        return 0.0
    if cluster.host_is_device:
        # CPU ranks: the optimizer runs where it always does (optimizer_time); disk adds the
        # calibrated cost of paging the offloaded states in and out each step
        if p.offload != "disk":
            return 0.0
        return model_states(psi, setup, p.zero, p.dp, p.offload, True).host * cluster.disk_overhead
    shard = psi / p.dp
    t_off = shard * (setup.grad_bytes + setup.param_bytes) / cluster.host_bw
    return t_off + shard * cluster.gpus_per_node / cluster.host_update_rate


def optimizer_time(cand: Candidate, setup: Setup, cluster: Cluster, psi: float) -> float:
    """The on-device optimizer step, bound by memory bandwidth: Adam reads the parameter,
    gradient and K bytes of state and writes the parameter and state back (Rajbhandari et
    al. 2020 §3.1 for K), for this rank's shard only under ZeRO-1+. A calibrated profile
    measures the optimizer's update rate (parameters/s) directly: PyTorch's AdamW on CPU
    runs tensor by tensor, several passes per tensor, well below the single-pass bound."""
    p = cand.plan
    if p.offload != "none" and not cluster.host_is_device:
        return 0.0
    shard = psi / (p.dp if p.zero >= 1 else p.ps_shards if p.dp_mode.startswith("ps-") else 1)
    if cluster.optimizer_rate:
        return shard / cluster.optimizer_rate
    per_param = setup.param_bytes + setup.grad_bytes + 2 * setup.optim_bytes + setup.param_bytes
    return shard * per_param / cluster.mem_bw
