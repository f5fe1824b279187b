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

from meshtrain.planner.hardware import Cluster
from meshtrain.planner.memory import stage_params
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup


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

    def to_dict(self) -> dict:
        return asdict(self)


def forward_flops_per_token(spec: ModelSpec, seq: int) -> tuple[float, float, float]:
    """(per layer, of which attention scores, logits) forward FLOPs for one token.

    Each weight is one multiply-add (2 FLOPs) per token; attention's QK^T and (attn)V add
    2 * 2 * s * h per token (Megatron 2021 §5.1: 24 B s h^2 + 4 B s^2 h per layer forward);
    the logit layer 2 h V."""
    attn_scores = 4 * seq * spec.hidden
    layer = 2 * spec.layer_matmul_params + attn_scores
    logits = 2 * spec.hidden * spec.vocab
    return layer, attn_scores, logits


def step_flops(spec: ModelSpec, global_batch: int, recompute: str = "none") -> float:
    """FLOPs of one training step over the whole cluster.

    Backward costs twice forward (Megatron 2021 §5.1), so a step is 3x forward; full
    recomputation re-runs every layer's forward (4x for the layers, the logit layer not
    recomputed); selective recomputation re-runs only the attention scores (Korthikanti 2022
    §5). For a GPT with full recomputation this is Megatron 2021's
        F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    Its "72 ..." form without recomputation keeps V/(16lh), which undercounts the logit layer
    (3 x 2BshV = 6BshV, i.e. V/(12lh) in that form); this function counts it as 6BshV.
    """
    layer, scores, logits = forward_flops_per_token(spec, spec.seq)
    per_token = 3 * (spec.layers * layer + logits)
    if recompute == "full":
        per_token += spec.layers * layer
    elif recompute == "selective":
        per_token += spec.layers * scores
    return global_batch * spec.seq * per_token


def model_flops(spec: ModelSpec, global_batch: int) -> float:
    """Useful FLOPs per step (no recomputation): the numerator of MFU (PaLM, Chowdhery et al.
    2022, Appendix B)."""
    return step_flops(spec, global_batch, "none")


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
    bucket's size). Buckets close at parameter boundaries; ignoring that is a small error."""
    if total <= 0:
        return 0, 0.0, 0.0
    full = int(total // bucket)
    rest = total - full * bucket
    if rest <= 0:
        return full - 1, float(bucket), float(bucket)
    return full, float(bucket), rest


def step_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster) -> StepTime:
    p = cand.plan
    b, m, s, h = cand.micro_batch, p.microbatches, spec.seq, spec.hidden
    # Compute per micro-batch on one rank: the model's FLOPs for b sequences over pp stages
    # (the busiest holds ceil(l/p) layers, plus the logit layer when pp = 1) and tp ranks.
    layer_f, scores_f, logits_f = forward_flops_per_token(spec, s)
    extra = layer_f if cand.recompute == "full" else scores_f if cand.recompute == "selective" else 0
    layers_here = math.ceil(spec.layers / p.pp)
    mb_flops = b * s * (layers_here * (3 * layer_f + extra) + 3 * logits_f) / p.tp
    t_mb = mb_flops / cluster.achievable_flops

    # Tensor parallel: 4 collectives of b s h per layer (2 forward, 2 backward; Megatron 2019
    # §3), 6 with full recomputation (its forward runs twice); ring all-reduce volume.
    act = b * s * h * setup.act_bytes
    n_tp = (6 if cand.recompute == "full" else 4) * layers_here
    t_tp = n_tp * cluster.collective_time("all_reduce", act, p.tp, p.tp)

    # Pipeline: each micro-batch sends b s h forward and its gradient back across a boundary;
    # with tp > 1 each tp rank sends 1/t and the receiver all-gathers over the fast link
    # (Megatron 2021 §4.1 scatter/gather optimisation).
    t_pp = 0.0
    if p.pp > 1:
        span = p.tp * p.dp * p.pp
        chunk = act / p.tp
        t_pp = 2 * cluster.collective_time("p2p", chunk, 2, span)
        if p.tp > 1:
            t_pp += 2 * cluster.collective_time("all_gather", act, p.tp, p.tp)
        t_pp *= p.virtual_stages  # interleaving multiplies the boundaries crossed (§2.2.2)

    slots = pipeline_slots(p.schedule, p.pp, m, p.virtual_stages)
    slot = t_mb + t_tp + t_pp
    compute = m * t_mb
    bubble = (slots - m) * slot
    pipeline = slots * slot

    # Data parallel (ZeRO §7.2): S = this rank's gradients. DDP / ZeRO-1: one all-reduce (or
    # reduce-scatter + all-gather) per step; ZeRO-2 reduce-scatters every micro-batch (it keeps
    # only a gradient shard) and all-gathers parameters once; ZeRO-3 all-gathers parameters in
    # forward and in backward and reduce-scatters gradients, every micro-batch: 1.5x DDP's
    # volume per micro-batch.
    psi = stage_params(spec, p.pp, p.tp)
    grad_bytes = psi * setup.grad_bytes
    param_bytes = psi * setup.param_bytes
    span = p.tp * p.dp
    coll = lambda kind, nbytes: cluster.collective_time(kind, nbytes, p.dp, span)
    stats = 0.0
    # the step's statistics: the loss, and meshtrain's DDP adds a used-flag per parameter
    # tensor (~13 per block)
    stats_bytes = 4 * (1 + 13 * math.ceil(spec.layers / p.pp))
    if p.zero == 0:
        # DDP all-reduces its gradient buckets (Plan.bucket_mb each, filled from the last
        # layer backwards), each at its own size on the measured curve; the statistics ride
        # in the last bucket.
        full, size, last_size = bucket_sizes(grad_bytes, p.bucket_mb * 2**20)
        last = coll("all_reduce", last_size + stats_bytes)
        t_dp = full * coll("all_reduce", size) + last
    elif p.zero == 1:
        # the same buckets reduce-scattered once per step (overlapped as DDP's), then the
        # updated parameters all-gathered after the optimizer step: nothing left to hide it
        full, size, last_size = bucket_sizes(grad_bytes, p.bucket_mb * 2**20)
        last = coll("reduce_scatter", last_size) + coll("all_gather", param_bytes)
        t_dp = full * coll("reduce_scatter", size) + last
    elif p.zero == 2:
        # the updated parameters' all-gather follows the optimizer step: no backward left
        # to hide it behind (DeepSpeed stage 2 runs it after the step)
        last = (coll("reduce_scatter", bucket_sizes(grad_bytes, p.bucket_mb * 2**20)[2])
                + coll("all_gather", param_bytes))
        t_dp = m * coll("reduce_scatter", grad_bytes) + coll("all_gather", param_bytes)
    else:
        t_dp = m * (2 * coll("all_gather", param_bytes) + coll("reduce_scatter", grad_bytes))
        # nothing is computed before the first unit's gather, nor after the last bucket
        unit = spec.largest_layer_params / p.tp * setup.param_bytes
        last = (coll("all_gather", unit)
                + coll("reduce_scatter", bucket_sizes(grad_bytes, p.bucket_mb * 2**20)[2]))
    if p.dp > 1 and p.zero >= 1:  # the statistics: one small all-reduce behind the gradients
        stats = coll("all_reduce", stats_bytes)
    # Overlap: DDP buckets overlap the all-reduce with the last micro-batch's backward (2/3
    # of its compute; Li et al. 2020, PyTorch DDP §3.2.3), ZeRO-2 its reduce-scatters with
    # every micro-batch's backward, except the last bucket, which is ready only when
    # backward ends; ZeRO-3 prefetches, hiding its traffic behind all compute
    # (Rajbhandari et al. 2020 §7.2.2). With pp > 1 the gradient exchange waits for the
    # pipeline flush (Megatron 2021 §2.2) and is not hidden. `cluster.overlap` scales what
    # can hide: 1 on GPUs (copy engines and NCCL's own SMs); on CPU ranks gloo's threads take
    # the cores backward runs on, so a local profile sets it low (see profile.py).
    if p.dp == 1:
        hidden = 0.0
    elif p.pp > 1:
        hidden = 0.0
    elif p.zero == 3:
        hidden = max(0.0, min(t_dp - last, compute)) * cluster.overlap
    elif p.zero == 2:  # the last micro-batch's last bucket, too, waits for backward's end
        hidden = max(0.0, min(t_dp - last, compute * 2 / 3)) * cluster.overlap
    else:
        hidden = max(0.0, min(t_dp - last, t_mb * 2 / 3)) * cluster.overlap
    exposed = max(0.0, t_dp - hidden) + stats

    # Offload (ZeRO-Offload §4): gradient shard to host, updated parameters back, over the
    # host link, and Adam on the host CPUs at host_update_rate shared by the node's GPUs.
    t_off = 0.0
    if p.offload != "none":
        shard = psi / p.dp
        t_off = shard * (setup.grad_bytes + setup.param_bytes) / cluster.host_bw
        t_off += shard * cluster.gpus_per_node / cluster.host_update_rate
    # The optimizer step is bound by memory bandwidth: Adam reads the parameter, gradient and
    # K bytes of state and writes the parameter and state back (Rajbhandari et al. 2020 §3.1
    # for K), for this rank's shard only under ZeRO-1+.
    # A calibrated profile measures the optimizer's update rate (parameters/s) directly:
    # PyTorch's AdamW on CPU runs tensor by tensor, several passes per tensor, well below
    # the single-pass bound.
    t_opt = 0.0
    if p.offload == "none":
        shard = psi / (p.dp if p.zero >= 1 else 1)
        per_param = setup.param_bytes + setup.grad_bytes + 2 * setup.optim_bytes + setup.param_bytes
        t_opt = shard * per_param / cluster.mem_bw
        if cluster.optimizer_rate:
            t_opt = shard / cluster.optimizer_rate
    total = pipeline + exposed + t_off + t_opt
    return StepTime(compute, bubble, m * t_tp, m * t_pp, t_dp, exposed, t_off, t_opt, total)
