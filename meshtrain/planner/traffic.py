"""Bytes each rank sends per step on each mesh axis, as `meshtrain plan --verify` measures
them (measure/verify.py): tensor parallel's collectives per block, pipeline boundaries,
data parallel's exchange (ZeRO §7 volumes, parameter servers, local steps, PowerSGD), and
what cp and ep send (context_parallel.step_bytes, experts.step_bytes); each stage's blocks
as the pipeline cuts them (planner/stage_split.py)."""
from __future__ import annotations

from meshtrain.core.plan import LOCAL_STEP_MODES
from meshtrain.planner import context_parallel, experts
from meshtrain.planner.compression import powersgd_traffic
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import stage_blocks
from meshtrain.planner.states import stage_params, zero3_gathered_bytes


def axis_bytes(spec: ModelSpec, cand: Candidate, setup: Setup, stage: int | None = None,
               server: bool = True) -> dict[str, float]:
    """Bytes one rank sends per step on each mesh axis, as meshtrain's Comm counts them (ring
    shares for collectives, whole messages point to point; a step's few statistics bytes
    left out): the busiest pipeline stage's rank, or `stage`'s; a parameter server's
    server or worker. Empty for DP's one process (its copies never leave it). cp and ep
    send their own (context_parallel.step_bytes, experts.step_bytes)."""
    out = context_parallel.step_bytes(spec, cand, setup)
    spec, cand = context_parallel.rank_view(spec, cand)
    out.update(experts.step_bytes(spec, cand, setup))
    p = cand.plan
    if p.dp_mode == "dp":
        return {}
    b, m, s, h = cand.micro_batch, p.microbatches, spec.seq, spec.hidden
    blocks = stage_blocks(spec, p)
    stages = range(p.pp) if stage is None else [stage]
    if p.tp > 1:   # per micro-batch: 2 all-reduces per block each way (one more forward
        # with full recomputation), the vocab-parallel embedding's on the first stage, the
        # head's and the loss's b s-sized three on the last (Megatron 2019 §3;
        # tests/multirank/test_tp_accounting.py)
        ring = 2 * (p.tp - 1) / p.tp
        per_block = 6 if cand.recompute == "full" else 4
        act = b * s * h * setup.act_bytes

        def tp_sent(st: int) -> float:
            first, last = st == 0, st == p.pp - 1
            layers_here = blocks[st]
            per_micro = (per_block * layers_here + first + last) * act + last * 3 * b * s * 4
            if not cand.sp:
                return m * ring * per_micro
            # sequence parallel: the embedding's split all-gathers in backward, and so do
            # the column layers' inputs, saved as slices (2 per block, the head's on the
            # last stage), (t-1)/t each; the replicated parameters' gradients, which saw only
            # a slice of the sequence, are all-reduced once a step (the norms and the
            # row-parallel biases)
            gathers = first + 2 * layers_here + last
            partial = (layers_here * spec.layer_replicated_params + last * spec.norm_params)
            return (m * (ring * per_micro + gathers * act * (p.tp - 1) / p.tp)
                    + ring * partial * setup.grad_bytes)

        out["tp"] = max(tp_sent(st) for st in stages)
    if p.pp > 1:   # each micro-batch's activation forward and gradient back, per boundary
        act = b * s * h * setup.act_bytes
        v = p.virtual_stages
        # chunk boundaries a stage sends across: activations out of every chunk but the
        # model's last, gradients out of every chunk but the model's first
        sends = [(v - (st == p.pp - 1)) + (v - (st == 0)) for st in stages]
        out["pp"] = m * act * max(sends)
    dense, expert_psi, edp = experts.expert_share(spec, cand, stage_params(spec, p, stage), stage)
    for q, psi in [(p, dense)] + ([(edp.plan, expert_psi)] if edp else []):   # experts: edp
        if q.dp == 1:
            continue
        grads, params = psi * setup.grad_bytes, psi * setup.param_bytes
        if q.zero == 3 and q is p:   # the float8 linears' weights gathered in e4m3
            params = zero3_gathered_bytes(spec, p, setup, psi, stage)
        share = (q.dp - 1) / q.dp
        if q.dp_mode.startswith("ps-"):
            k = q.ps_shards
            # a worker pushes the shards it does not serve; a server also sends its shard's
            # update to every other worker
            sent = (grads * (k - 1) / k + (q.dp - 1) * params / k) if server else grads
        elif q.dp_mode in LOCAL_STEP_MODES:   # the parameters, every sync_every steps
            sent = 2 * share * params / q.sync_every
        elif q.compression == "powersgd":   # the factors, and what is sent whole
            t = powersgd_traffic(spec, q.compression_rank, q.compression_min_rate)
            sent = 2 * share * (t.whole + t.p + t.q) * setup.grad_bytes
        elif q.zero == 0:
            sent = 2 * share * grads
        elif q.zero == 1 or (q.zero == 3 and q.pp > 1 and not q.zero3_regather):   # ZeRO-3
            sent = share * (grads + params)   # kept under stages: once, as ZeRO-1
        elif q.zero == 2:   # a reduce-scatter every micro-batch, one all-gather; under
            # stages too (under interleaved ones each reaches one chunk: m of them a chunk)
            sent = share * (m * grads + params)
        else:   # gathered for forward and again for backward (but what is gathered once),
            # scattered, every micro-batch
            once = spec.gathered_once_params / q.tp * setup.param_bytes
            sent = m * share * (2 * params - (once if q is p and p.pp == 1 else 0.0) + grads)
        out["dp"] = out.get("dp", 0.0) + sent
    return out
