"""Memory per rank for one candidate plan: model states (`states.py`), activations
(`activations.py`), buffers, backward's transients and the runtime's own working memory,
per role (pipeline stage, parameter server or worker) and on the busiest rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from meshtrain.core.plan import LOCAL_STEP_MODES
from meshtrain.planner import context_parallel, experts
from meshtrain.planner.activations import (forward_traffic, full_layer_bytes, inflight_microbatches,
                                           output_bytes, selective_layer_bytes,
                                           stage_layers_bytes, transient_bytes)
from meshtrain.planner.compression import powersgd_traffic
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import stage_blocks
from meshtrain.planner.states import (gathered_unit_bytes, local_step_states, master_states,
                                      server_states, stage_params, staged_buffer_bytes,
                                      zero3_gathered_bytes)


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
    build: float = 0.0          # bytes while the model is built or loaded: what the rank
                                # keeps of it plus one whole tensor being made (derived)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def allocated(self) -> float:
        """Peak bytes of live tensors: states, saved activations, buffers, transients."""
        return self.model_states + self.activations + self.buffers + self.transient

    @property
    def total(self) -> float:
        """Peak bytes the rank's process needs: tensors (while training, or while building,
        whichever holds more) plus the runtime's own working memory."""
        return max(self.allocated, self.build) + self.runtime

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "allocated": self.allocated,
                "total": self.total}


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
                  extra: float | tuple = 0.0, sp_heap: float = 0.0,
                  optimizer_step: float | None = None) -> dict[str, Memory]:
    """Device memory per role (`rank_role`): one entry per pipeline stage, and per server
    and worker of a parameter server whose shards do not cover every rank.
    `optimizer_step`: bytes per parameter the optimizer's step allocates beside the states
    (`optimizer_step_bytes`); None leaves the step's moment out (CPU ranks and presets).
    A cp rank is priced as its view (context_parallel.rank_view), with the blocks its
    attention exchanges beside; expert parallel's dispatch buffers are beside too."""
    exchange = context_parallel.transient_bytes(spec, cand, setup)
    spec, cand = context_parallel.rank_view(spec, cand)
    exchange += experts.transient_bytes(spec, cand, setup)
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
                ps and dp_rank < p.ps_shards, staging, extra, sp_heap, optimizer_step)
    if exchange:
        roles = {role: replace(m, transient=m.transient + exchange) for role, m in roles.items()}
    return roles


def memory(spec: ModelSpec, cand: Candidate, setup: Setup, bucket_bytes: float | None = None,
           runtime: tuple[float, ...] = (0.0, 0.0), host_is_device: bool = False,
           staging: float = 0.0, extra: float | tuple = 0.0, sp_heap: float = 0.0,
           optimizer_step: float | None = None) -> Memory:
    """Device memory on the busiest rank of `cand` (the stage that needs most), and what
    offload puts on the host.

    `runtime` = (fixed bytes, bytes per byte of a micro-batch's forward traffic[, per byte of
    its first layer's: the same as the rest if left out[, bytes that accumulating over
    several micro-batches adds]]): the process's working memory that no tensor accounts for, calibrated on the machine (`meshtrain plan --calibrate`; see
    `meshtrain.measure.fit.fit_runtime_memory`). On GPU presets it is 0: `Cluster.reserve` covers the
    CUDA context and the caching allocator's fragmentation instead."""
    return max(role_memories(spec, cand, setup, bucket_bytes, runtime, host_is_device,
                             staging, extra, sp_heap, optimizer_step).values(),
               key=lambda m: m.total)


def _zero_buffers(spec: ModelSpec, cand: Candidate, setup: Setup, psi: float,
                  bucket_bytes: float | None, stage: int) -> float:
    """ZeRO's gradient and parameter buffers on pipeline rank `stage`, of `psi` parameters
    (ZeRO-3's float8 linears' weights gathered at 1 byte: strategies/zero/float8_gather.py). DDP and ZeRO-1
    reduce gradients in place (they are views of the flat buckets, as in PyTorch DDP with
    gradient_as_bucket_view and meshtrain's DDP); ZeRO-2 needs a bucket to reduce-scatter
    from before keeping only its shard."""
    p = cand.plan
    buffers = 0.0
    if p.zero == 2:   # a bucket: Plan.bucket_mb, or the stage's gradients if fewer; with
        # several micro-batches, the last one's reduce-scatter may still hold its bucket
        # when the next backward fills a fresh one (seen in the allocator's events). Under
        # stages one: a round's bucket is full only once its backward has freed the
        # micro-batch's activations, of the several the stage holds (measured: dp2 x pp2,
        # 1F1B and interleaved V=2, within 4% on both stages; was 15-19% over)
        bucket = bucket_bytes if bucket_bytes is not None else p.bucket_mb * 2**20
        twice = p.microbatches > 1 and p.pp == 1
        buffers = min(bucket, psi * setup.grad_bytes) * (2 if twice else 1)
    if p.zero == 3 and p.pp > 1 and not p.zero3_regather:   # the stage's units stay and its
        # gradients accumulate whole from its first forward to its last backward (zero3.py,
        # [Note: ZeRO-3 under pipeline stages])
        buffers += zero3_gathered_bytes(spec, p, setup, psi, stage) + psi * setup.grad_bytes
    elif p.zero == 3:  # a gathered unit and the prefetched next one, and its full gradient
        # (pp = 1, or zero3_regather: gathered for each micro-batch's forward and backward)
        unit = spec.largest_layer_params / p.tp
        buffers += 2 * gathered_unit_bytes(spec, p, setup) + unit * setup.grad_bytes
    return buffers


def _rerun_bytes(spec: ModelSpec, cand: Candidate, setup: Setup, block: float,
                 host_is_device: bool) -> float:
    """What full recomputation's backward holds beside the saved layer inputs: one layer's
    forward re-run (its full set) and its backward's ffn-wide gradients (`block`); under
    ZeRO-3, mid-backward, the units after it still reduce-scattering (at most two in
    flight), each its whole gradient beside it and, on CPU ranks, a receive buffer as large
    (gloo's all-to-all): measured 3.7-5.7 units of gradient on CPU ranks. Per-op selective
    recomputation re-runs only what the layer did not keep."""
    rerun = block + full_layer_bytes(spec, cand, setup)
    if cand.recompute == "selective":
        rerun -= selective_layer_bytes(spec, spec.seq, cand.micro_batch, cand.plan.tp, cand.sp,
                                       setup.act_bytes, experts.routed_rows(spec, cand))
    if cand.plan.zero == 3 and (cand.plan.pp == 1 or cand.plan.zero3_regather):   # else whole
        unit_grad = setup.grad_bytes * spec.largest_layer_params / cand.plan.tp
        rerun += 2 * unit_grad * (2 if host_is_device else 1)
    return rerun


def float8_casts(spec: ModelSpec, cand: Candidate) -> float:
    """The float8 casts one block linear's backward holds until it returns, under fp8: its
    output gradient cast twice (once per GEMM), its weight and its input once each, 1 byte
    an element (the layout copies the GEMMs may ask for not counted); the largest of the
    MLP's linears (h in and f / t out, or f / t in and h out). torchao keeps no float8 copy
    from forward to backward (it saves the bf16 input and weight and casts them again), so
    an fp8 plan's activations are bf16's."""
    if cand.plan.precision != "fp8":
        return 0.0
    h, f = spec.hidden, spec.ffn_hidden / cand.plan.tp
    tokens = spec.seq * cand.micro_batch
    return h * f + tokens * max(2 * f + h, 2 * h + f)


def optimizer_step_bytes(optim_states: float, setup: Setup, temporaries: float) -> float:
    """Bytes the optimizer step allocates beside the model states on a rank that holds
    `optim_states` bytes of optimizer states (setup.optim_bytes per parameter it steps):
    under mixed precision the masters' fp32 gradients (made before the step, freed after:
    strategies/shared/precision.py), and `temporaries` bytes per parameter of the step's own
    (measured by calibration: PyTorch's fused AdamW none, its foreach one fp32 copy)."""
    params = optim_states / setup.optim_bytes
    return params * ((4 if setup.precision != "fp32" else 0) + temporaries)


def stage_memories(spec: ModelSpec, cand: Candidate, setup: Setup, **terms) -> list[Memory]:
    """Device memory of each pipeline stage's first rank (one entry when pp = 1): the first
    stage holds the embedding and the most micro-batches in flight, the last the head and
    the output layer's activations and logits. `terms` as `role_memories` takes them."""
    p = cand.plan
    roles = role_memories(spec, cand, setup, **terms)
    return [roles[rank_role(p, stage * p.tp * p.dp)] for stage in range(p.pp)]


def _received_ahead(spec: ModelSpec, cand: Candidate, setup: Setup, last: bool,
                    host_is_device: bool) -> float:
    """CPU ranks post a neighbour's next message ahead (pipeline/runtime.py [Note: receiving
    ahead]): one boundary tensor (whole under tp) beside a stage's peak; measured, the last
    stage's peak (the loss's backward) does not rise by it."""
    if cand.plan.pp == 1 or not host_is_device or last:
        return 0.0
    return spec.seq * cand.micro_batch * spec.hidden * setup.act_bytes


def _stage_memory(spec: ModelSpec, cand: Candidate, setup: Setup, stage: int,
                  bucket_bytes: float | None, runtime: tuple[float, ...],
                  host_is_device: bool, server: bool = False, staging: float = 0.0,
                  extra: float | tuple = 0.0, sp_heap: float = 0.0,
                  optimizer_step: float | None = None) -> Memory:
    p = cand.plan
    last = stage == p.pp - 1
    psi = stage_params(spec, p, stage)
    states = experts.rank_states(spec, cand, setup, psi, host_is_device, stage)
    if p.dp_mode.startswith("ps-"):
        states = server_states(psi, setup, p.ps_shards, server)
    elif p.dp_mode == "dp":
        states = master_states(psi, setup, p.dp)
    elif p.dp_mode in LOCAL_STEP_MODES:
        states = local_step_states(psi, setup, p.dp_mode == "diloco" and p.outer_momentum > 0)
    elif p.compression == "powersgd":   # each compressed matrix's residual and Q, counted
        # with the gradients as powersgd.py's memory() does
        kept = powersgd_traffic(spec, p.compression_rank, p.compression_min_rate).kept
        states = replace(states, grads=states.grads + kept * setup.grad_bytes)
    layers_here = stage_blocks(spec, p)[stage]
    inflight = inflight_microbatches(p.schedule, p.pp, p.microbatches, p.virtual_stages, stage)
    acts = stage_layers_bytes(spec, cand, setup, layers_here) * inflight
    first, rest = forward_traffic(spec, cand, setup, stage)
    if last:   # the output layer lives on the last stage: the final norm's and the
        # projection's inputs (2 s b h elements) and the fp32 logits, for one micro-batch,
        # for all of them under GPipe (every forward, the loss's too, before any backward)
        acts += output_bytes(spec, cand, setup) * (inflight if p.schedule == "gpipe" else 1)
    buffers = _zero_buffers(spec, cand, setup, psi, bucket_bytes, stage)
    # the loss's backward works on logits-shaped tensors: on the last stage only; a stage
    # without the loss peaks in its last block's backward, with every activation still
    # saved, in the MLP's ffn-wide gradients (measured against the allocator's events:
    # 1.5 ffn s b elements at b >= 8 on meshtrain's GPT, the two around the activation
    # function overlapping in part)
    absorb = setup.grad_bytes * spec.largest_tensor_params / p.tp
    block = 1.5 * spec.ffn_hidden / p.tp * spec.seq * cand.micro_batch * setup.act_bytes
    block += float8_casts(spec, cand)
    transient = transient_bytes(spec, cand, setup) if last else absorb + block
    if cand.sp:   # meshtrain's sequence-parallel backward: an all-gather's output and its
        # reshaped copy (the regathered input of a column layer), a reduce-scatter's
        # contiguous copy, each a whole activation (measured: 3-12 of them above the saved
        # tensors, varying with when gloo's threads free theirs)
        transient += 3 * setup.act_bytes * spec.seq * cand.micro_batch * spec.hidden
    if cand.recompute in ("full", "selective"):   # on the last stage, once the loss's
        # backward is over and the output layer's tensors are freed: the larger is the peak
        recomputed = _rerun_bytes(spec, cand, setup, block, host_is_device)
        if last:
            transient = max(transient, recomputed - output_bytes(spec, cand, setup))
        else:
            transient += recomputed
    transient += _received_ahead(spec, cand, setup, last, host_is_device)
    if optimizer_step is not None:   # the step's other moment, once backward has freed the
        # activations: its own tensors beside the states (the larger moment is the peak)
        step = optimizer_step_bytes(states.optim, setup, optimizer_step)
        transient = max(transient, step - acts - buffers)
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
    # building (strategies/materialise.py): what the rank keeps, and one whole fp32 tensor
    build = states.params + states.grads + 4 * spec.largest_tensor_params
    return Memory(states.params, states.grads, states.optim, acts, buffers, states.host,
                  transient, runtime_bytes, build)
