"""Memory per rank for one candidate plan: model states, activations, buffers.

Sources, each quoted where its formula is used:
- ZeRO, Rajbhandari et al. 2020 (SC'20), §3.1 and Table 1: model states (2 + 2 + K) Psi bytes
  for mixed-precision Adam, divided by N_d as P_os, P_os+g, P_os+g+p shard them.
- ZeRO-Offload, Ren et al. 2021 (ATC'21) §3-4 and ZeRO-Infinity, Rajbhandari et al. 2021:
  optimizer states and gradients (and, with stage 3, parameters) held in host memory.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  §4 and Table 2: activation bytes per transformer layer; §4.2.3 pipeline in-flight counts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optim: float
    host: float = 0.0           # bytes moved to host memory (or disk) by offload

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optim


@dataclass(frozen=True)
class Memory:
    """Device bytes on the busiest rank, by kind, and host bytes that offload adds."""
    params: float
    grads: float
    optim: float
    activations: float
    buffers: float
    host: float
    transient: float = 0.0      # backward's working tensors at the peak (derived)
    runtime: float = 0.0        # the process's working memory outside tensors (calibrated)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def allocated(self) -> float:
        """Peak bytes of live tensors: states, saved activations, buffers, transients."""
        return self.model_states + self.activations + self.buffers + self.transient

    @property
    def total(self) -> float:
        """Peak bytes the rank's process needs: tensors plus the runtime's own working memory."""
        return self.allocated + self.runtime

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "allocated": self.allocated,
                "total": self.total}


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


def layer_activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, tp: int = 1,
                           sp: bool = False, recompute: str = "none",
                           elem_bytes: int = 2, gathered_inputs: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti 2022, Table 2).

    In 16-bit with dropout and multi-head attention the paper's counts are:
      none:                       s b h (34 + 5 a s / h)
      tensor parallel t:          s b h (10 + 24/t + 5 a s / (h t))
      tensor + sequence parallel: s b h (34/t + 5 a s / (h t))
      selective recomputation:    s b h (10 + 24/t)      (with sequence parallel: 34 s b h / t)
      full recomputation:         2 s b h                (only the layer's input)
    Built from its §4.1 parts so they also hold for other shapes: the 10 that TP leaves
    replicated are the two LayerNorm inputs (4sbh), the attention and MLP inputs (4sbh) and
    two 1-byte dropout masks (2sbh); the 24 TP divides are Q, K, V and the projection input
    (8sbh) and the MLP's two 4h-wide tensors (16sbh); the scores are softmax output (2),
    dropout mask (1) and dropout output (2) per a s^2 b. Other element sizes scale the
    2-byte terms; masks stay 1 byte.
    `gathered_inputs`: under sequence parallel, the attention and MLP inputs are saved as
    all-gathered (whole sequence: meshtrain's runtime), not as this rank's slice re-gathered
    in backward (Megatron-LM, the paper's 34/t).
    """
    s, b, h, a, e = seq, micro_batch, spec.hidden, spec.heads, elem_bytes
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (tp if sp else 1)
    masks = 2 if spec.dropout else 0
    kept = (4 * e + masks) / (tp if sp else 1)
    if sp and gathered_inputs:   # the LayerNorm inputs and masks split, those two whole
        kept = (2 * e + masks) / tp + 2 * e
    attn = e * (2 + 2 * spec.kv_dim / h)
    mlp = e * (4 if spec.mlp == "swiglu" else 2) * spec.ffn_hidden / h
    divided = attn + mlp
    if recompute == "selective" or spec.flash_attention:
        scores = 0.0
    else:
        scores = (a * s / h) * (e + (1 + e if spec.dropout else 0))
    return sbh * (kept + (divided + scores) / tp)


def inflight_microbatches(schedule: str, pp: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at its peak.

    pp = 1: micro-batches run one after another (gradient accumulation): 1.
    GPipe (Huang et al. 2019): all m forwards before any backward: m, on every stage.
    1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): stage s runs p - s forwards before
    its first backward: min(m, p - s) (p on the first stage, 1 on the last).
    Interleaved with v chunks per rank (Megatron 2021 §2.2.2 warm-up of 2(p - s - 1) +
    (v - 1) p chunk-forwards, then one more before the first backward): in units of a whole
    stage's layers, (2(p - s - 1) + (v - 1) p + 1) / v; on the first stage that is
    p (1 + (p-1)/(p v)), Korthikanti 2022 §4.2.3.
    Naive model parallel: one micro-batch moves through at a time: 1.
    """
    if pp == 1 or schedule == "naive":
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(m, (2 * (pp - stage - 1) + (v - 1) * pp + 1) / v)
    if schedule == "zb-h1":   # rank r defers r W's: every stage holds up to P (schedules.py)
        return min(m, pp)
    return min(m, pp - stage)


def stage_params(spec: ModelSpec, pp: int, tp: int, stage: int | None = None) -> float:
    """Parameters on pipeline stage `stage` (None: the busiest): ceil(l/p) blocks, plus the
    embedding on the first stage and the head on the last, split t ways except what tensor
    parallel keeps whole on every rank (Megatron: vocab-parallel embedding and column/row-
    parallel matrices are split; the norms, the row-parallel biases and a learned position
    embedding are replicated)."""
    layers_here = math.ceil(spec.layers / pp)
    per_stage = layers_here * spec.layer_params
    if spec.measured_params:   # keep the exact total when it was read from a module
        per_stage = spec.measured_params - spec.embedding_params - spec.head_params
        per_stage = layers_here * per_stage / spec.layers
    whole_stage = layers_here * spec.layer_replicated_params
    first = (per_stage + spec.embedding_params, whole_stage + spec.embedding_replicated_params)
    last = (per_stage + spec.head_params + (spec.vocab * spec.hidden if spec.tied and pp > 1 else 0),
            whole_stage + spec.norm_params)
    if pp == 1:
        stages = [(first[0] + spec.head_params, first[1] + spec.norm_params)]
    else:
        stages = [first] + [(per_stage, whole_stage)] * (pp - 2) + [last]

    def on_rank(total: float, whole: float) -> float:
        return total if tp == 1 else (total - whole) / tp + whole

    if stage is not None:
        return on_rank(*stages[stage])
    return max(on_rank(*st) for st in stages)


def logits_bytes(spec: ModelSpec, seq: int, micro_batch: int, tp: int) -> float:
    """The output layer's fp32 logits for cross-entropy: 4 s b V / t bytes (Korthikanti 2022,
    §4.3), kept on the last stage for one micro-batch."""
    return 4 * seq * micro_batch * spec.vocab / tp


def transient_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Working tensors that exist beside the saved activations at the step's peak (derived).

    The peak falls as backward starts, when every saved activation is still alive. Then:
    - the cross-entropy's gradient w.r.t. the log-probabilities and the log-softmax
      backward's gradient w.r.t. the logits, both fp32 and logits-shaped: 2 x 4 s b V / t;
    - one freshly produced parameter gradient before it is copied into its DDP bucket (the
      "absorb" transient; also the size of a single-tensor AdamW temporary): the largest
      weight matrix's gradient, grad_bytes x largest_tensor_params / t.
    Checked against the CPU allocator's exact peak (torch.profiler profile_memory) for
    meshtrain's GPT: exact when an h x 4h matrix is the largest (the absorb transient then
    coincides with the logits' gradients); when the vocabulary dominates, the second term
    does not coincide with the first and this over-states the peak by that one gradient.
    """
    p = cand.plan
    logits = 2 * logits_bytes(spec, spec.seq, cand.micro_batch, p.tp)
    absorb = setup.grad_bytes * spec.largest_tensor_params / p.tp
    return logits + absorb


def rank_role(plan, rank: int) -> str:
    """What global `rank` holds under `plan`, as the per-rank reports name it: its pipeline
    stage, whether it hosts a parameter-server shard, or "every rank" where all are alike.
    Mesh layout ("pp", "dp", "tp"), tp fastest-varying (ARCHITECTURE.md)."""
    dp_rank = (rank // plan.tp) % plan.dp
    stage = rank // (plan.tp * plan.dp)
    parts = []
    if plan.pp > 1:
        parts.append(f"stage {stage}")
    if plan.dp_mode == "dp":
        parts.append("master")
    elif plan.dp_mode.startswith("ps-") and plan.ps_shards < plan.dp:
        parts.append("server" if dp_rank < plan.ps_shards else "worker")
    return ", ".join(parts) or "every rank"


def role_memories(spec: ModelSpec, cand: Candidate, setup: Setup,
                  bucket_bytes: float | None = None,
                  runtime: tuple[float, ...] = (0.0, 0.0),
                  host_is_device: bool = False, staging: float = 0.0,
                  extra: float | tuple = 0.0, sp_heap: float = 0.0) -> dict[str, Memory]:
    """Device memory per role (`rank_role`): one entry per pipeline stage, and per server
    and worker of a parameter server whose shards do not cover every rank."""
    p = cand.plan
    ps = p.dp_mode.startswith("ps-")
    # one rank of each role (the advisor asks for thousands of plans: never walk the world):
    # a stage's first dp rank (a server under ps), and its first worker where there is one
    dp_ranks = [0] + ([p.ps_shards] if ps and p.ps_shards < p.dp else [])
    roles: dict[str, Memory] = {}
    for stage in range(p.pp):
        for dp_rank in dp_ranks:
            rank = (stage * p.dp + dp_rank) * p.tp
            roles[rank_role(p, rank)] = _stage_memory(
                spec, cand, setup, stage, bucket_bytes, runtime, host_is_device,
                ps and dp_rank < p.ps_shards, staging, extra, sp_heap)
    return roles


def memory(spec: ModelSpec, cand: Candidate, setup: Setup, bucket_bytes: float | None = None,
           runtime: tuple[float, ...] = (0.0, 0.0), host_is_device: bool = False,
           staging: float = 0.0, extra: float | tuple = 0.0, sp_heap: float = 0.0) -> Memory:
    """Device memory on the busiest rank of `cand` (the stage that needs most), and what
    offload puts on the host.

    `runtime` = (fixed bytes, bytes per byte of a micro-batch's forward traffic[, per byte of
    its first layer's: the same as the rest if left out[, bytes that accumulating over
    several micro-batches adds]]): the process's working memory that no tensor accounts for, calibrated on the machine (`meshtrain plan --calibrate`; see
    `calibrate.fit_runtime_memory`). On GPU presets it is 0: `Cluster.reserve` covers the
    CUDA context and the caching allocator's fragmentation instead."""
    return max(role_memories(spec, cand, setup, bucket_bytes, runtime, host_is_device,
                             staging, extra, sp_heap).values(), key=lambda m: m.total)


def stage_memories(spec: ModelSpec, cand: Candidate, setup: Setup, **terms) -> list[Memory]:
    """Device memory of each pipeline stage's first rank (one entry when pp = 1): the first
    stage holds the embedding and the most micro-batches in flight, the last the head and
    the output layer's activations and logits. `terms` as `role_memories` takes them."""
    p = cand.plan
    roles = role_memories(spec, cand, setup, **terms)
    return [roles[rank_role(p, stage * p.tp * p.dp)] for stage in range(p.pp)]


def _stage_memory(spec: ModelSpec, cand: Candidate, setup: Setup, stage: int,
                  bucket_bytes: float | None, runtime: tuple[float, ...],
                  host_is_device: bool, server: bool = False, staging: float = 0.0,
                  extra: float | tuple = 0.0, sp_heap: float = 0.0) -> Memory:
    p = cand.plan
    last = stage == p.pp - 1
    psi = stage_params(spec, p.pp, p.tp, stage)
    states = model_states(psi, setup, p.zero, p.dp, p.offload, host_is_device)
    if p.dp_mode.startswith("ps-"):
        states = server_states(psi, setup, p.ps_shards, server)
    elif p.dp_mode == "dp":
        states = master_states(psi, setup, p.dp)
    per_layer = layer_activation_bytes(spec, spec.seq, cand.micro_batch, p.tp, cand.sp,
                                       cand.recompute, setup.act_bytes, not setup.sp_saves_slices)
    layers_here = math.ceil(spec.layers / p.pp)
    inflight = inflight_microbatches(p.schedule, p.pp, p.microbatches, p.virtual_stages, stage)
    acts = per_layer * layers_here * inflight
    first, rest = forward_traffic(spec, cand, setup, stage)
    if last:   # the output layer lives on the last stage: the final norm's and the
        # projection's inputs (2 s b h elements) and the fp32 logits, for one micro-batch
        acts += output_bytes(spec, cand, setup)
    # DDP and ZeRO-1 reduce gradients in place (they are views of the flat buckets, as in
    # PyTorch DDP with gradient_as_bucket_view and meshtrain's DDP); ZeRO-2 needs a bucket to
    # reduce-scatter from before keeping only its shard.
    buffers = 0.0
    if p.zero == 2:   # a bucket: Plan.bucket_mb, or the stage's gradients if fewer; with
        # several micro-batches, the last one's reduce-scatter may still hold its bucket
        # when the next backward fills a fresh one (seen in the allocator's events)
        bucket = bucket_bytes if bucket_bytes is not None else p.bucket_mb * 2**20
        buffers = min(bucket, psi * setup.grad_bytes) * (2 if p.microbatches > 1 else 1)
    if p.zero == 3:  # a gathered unit and the prefetched next one, and its full gradient
        unit = spec.largest_layer_params / p.tp
        buffers += unit * (2 * setup.param_bytes + setup.grad_bytes)
    # the loss's backward works on logits-shaped tensors: on the last stage only; a stage
    # without the loss peaks in its last block's backward, with every activation still
    # saved, in the MLP's ffn-wide gradients (measured against the allocator's events:
    # 1.5 ffn s b elements at b >= 8 on meshtrain's GPT, the two around the activation
    # function overlapping in part)
    absorb = setup.grad_bytes * spec.largest_tensor_params / p.tp
    block = 1.5 * spec.ffn_hidden / p.tp * spec.seq * cand.micro_batch * setup.act_bytes
    transient = transient_bytes(spec, cand, setup) if last else absorb + block
    if cand.sp and not setup.sp_saves_slices:   # meshtrain's sequence-parallel backward: an
        # all-gather's output and its reshaped copy, a reduce-scatter's contiguous copy,
        # each a whole activation (measured: 3-12 of them above the saved tensors, varying
        # with when gloo's threads free theirs)
        transient += 3 * setup.act_bytes * spec.seq * cand.micro_batch * spec.hidden
    if cand.recompute == "full":  # backward re-runs one layer's forward: its full set is
        # live, and its backward's ffn-wide gradients beside it
        transient += block + full_layer_bytes(spec, cand, setup)
    fixed, per_act, *more = runtime
    per_first = more[0] if more else per_act
    # several micro-batches a step outside a pipeline: the next one's forward runs beside
    # the gradients the first made in its heap (calibrated; a pipeline's is in `extra`)
    accumulation = more[1] if len(more) > 1 and p.microbatches > 1 and p.pp == 1 else 0.0
    # the runtime's own memory: fixed, the heap the activations leave behind, the staging
    # buffers ZeRO's gathers and scatters need on a CPU backend (gloo: Comm runs both as
    # all-to-alls, each with a whole buffer beside its output), and what
    # tensor and pipeline parallel's own buffers add. ZeRO-1/2 gather and scatter their
    # flat buckets once backward is over, in the heap the activations left: the larger of
    # the two counts; ZeRO-3 gathers while the activations are alive: both count.
    # DP's replicas run in threads, whose glibc arenas hand their freed tops back to the
    # OS: no activations' heap stays behind there
    heap = 0.0 if p.dp_mode == "dp" else per_first * first + per_act * rest + accumulation
    staged = staging * staged_buffer_bytes(spec, cand, setup)
    heap = heap + staged if p.zero == 3 else max(heap, staged)
    if isinstance(extra, tuple):   # per stage kind: (a stage before the last, the last)
        extra = extra[last]
    if cand.sp:   # sequence parallel's gathers and scatters, a few per layer, each staged
        # by a CPU backend: grows with the forward traffic (calibrated; 0 on presets)
        extra += sp_heap * (first + rest)
    runtime_bytes = fixed + heap + extra
    return Memory(states.params, states.grads, states.optim, acts, buffers, states.host,
                  transient, runtime_bytes)


def output_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The output layer's activations for one micro-batch, on the last stage: the final
    norm's and the projection's inputs (2 s b h elements; under sequence parallel the
    norm's a slice, the projection's too where it is re-gathered in backward) and the fp32
    logits."""
    p = cand.plan
    sbh = setup.act_bytes * spec.seq * cand.micro_batch * spec.hidden
    split = p.tp if cand.sp else 1
    projection = sbh / (split if setup.sp_saves_slices else 1)
    return sbh / split + projection + logits_bytes(spec, spec.seq, cand.micro_batch, p.tp)


def full_layer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Everything one layer's forward makes for one micro-batch, saved or not (nothing
    recomputed): what a recomputed layer holds again, and the heap's unit."""
    return layer_activation_bytes(spec, spec.seq, cand.micro_batch, cand.plan.tp, cand.sp,
                                  "none", setup.act_bytes, not setup.sp_saves_slices)


def forward_traffic(spec: ModelSpec, cand: Candidate, setup: Setup, stage: int
                    ) -> tuple[float, float]:
    """What one micro-batch's forward allocates on `stage`, saved or not, as (its first
    layer's, the rest: its other layers' and the output layer's on the last stage). The heap
    the runtime keeps grows with it (the next micro-batch reuses what this one freed,
    whatever is in flight); measured, glibc keeps most of one layer's temporaries and a
    smaller part of each further layer's (calibrate.fit_runtime_memory). An interleaved
    stage runs its chunks' forwards apart, each from its own first layer: "first" is theirs."""
    p = cand.plan
    layer = full_layer_bytes(spec, cand, setup)
    layers_here = math.ceil(spec.layers / p.pp)
    chunks = min(p.virtual_stages, layers_here)
    rest = layer * (layers_here - chunks)
    if stage == p.pp - 1:
        rest += output_bytes(spec, cand, setup)
    return layer * chunks, rest


def collective_buffer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The largest buffer one of ZeRO's collectives gathers or scatters: a flat bucket under
    ZeRO-1/2 (the stage's parameters, at most Plan.bucket_mb), a unit under ZeRO-3."""
    p = cand.plan
    if p.zero == 0 or p.dp == 1:
        return 0.0
    if p.zero == 3:
        return spec.largest_layer_params / p.tp * setup.param_bytes
    return min(stage_params(spec, p.pp, p.tp) * setup.param_bytes, p.bucket_mb * 2**20)


def staged_buffer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The buffer bytes a CPU backend's staging copies grow with (calibrated per byte):
    ZeRO's largest collective buffer; under ZeRO-3 with full recomputation, once per layer
    of the stage (each layer's re-run forward gathers its unit again amid the recomputed
    activations: measured on meshtrain's GPT, the staging grows with the depth, 2 to 4
    blocks: +30 MB against one buffer's count)."""
    buffer = collective_buffer_bytes(spec, cand, setup)
    if cand.plan.zero == 3 and cand.recompute == "full":
        buffer *= math.ceil(spec.layers / cand.plan.pp)
    return buffer


def largest_layer_bytes(spec: ModelSpec, setup: Setup, tp: int = 1) -> float:
    """A single layer with its gradient and optimizer state: (2 + 2 + K) Psi_layer / t."""
    per_param = setup.param_bytes + setup.grad_bytes + setup.optim_bytes
    return spec.largest_layer_params * per_param / tp
