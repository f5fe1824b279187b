"""The advisor: enumerate every valid plan, drop those that do not fit, rank the rest.

Enumeration over (tp, pp, dp, micro-batch, schedule, virtual stages, ZeRO, offload,
recomputation), pruned so a 64-GPU cluster takes well under a second:
- tp divides the GPUs of one node and the heads (tp <= gpus per node: Megatron 2021
  Takeaway #1, tensor parallel only over NVLink);
- cp sits next to tp inside a node (tp x cp divides its GPUs) where 2 cp divides the
  sequence, as a ring, and as all-to-all where cp x tp divides the (key/value) heads; a cp
  plan whose micro-batch of b sequences cp divides is skipped: dp x cp replicas of b / cp
  sequences hold, compute and reduce the same, without cp's exchange;
- ep divides dp and the experts, where the model has experts;
- pp divides the layers' count at most, dp = world / (tp pp) divides the global batch;
- ZeRO-2 only without pipelining (its per-micro-batch gradient sharding fights pipelined
  accumulation; DeepSpeed refuses the combination); ZeRO-3 with pipelining as torchtitan
  runs FSDP under pp: units gathered once a step, gradients reduce-scattered once;
- offload, recomputation and (pp > 1) stages balanced by parameters are tried only when
  the plain variant does not fit: offload and recomputation are strictly slower with
  everything else equal, so they can never outrank it; the parameter balance evens the
  stages' weights rather than their FLOPs and, with the embedding counted, gives stage 0
  (and its in-flight activations) fewer blocks: less memory on the fullest rank of a
  large-vocabulary model; of the variants that fit, only the fastest is ranked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from meshtrain.core.admit import check_plan
from meshtrain.core.plan import Plan, PlanError
from meshtrain.planner.context_parallel import styles as cp_styles
from meshtrain.planner.experts import ep_sizes
from meshtrain.planner.flops import model_flops
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.memory import Memory, memory
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import RECOMPUTE, Candidate, Setup
from meshtrain.planner.stage_split import stage_balances
from meshtrain.planner.time_model import StepTime, step_time


class NoPlanFits(ValueError):
    """No plan fits: the message says by how much and what would make one fit."""


@dataclass(frozen=True)
class Evaluated:
    cand: Candidate
    mem: Memory
    time: StepTime
    fits: bool
    tokens_per_s: float
    mfu: float

    def to_dict(self) -> dict:
        return {**self.cand.to_dict(), "memory": self.mem.to_dict(),
                "time": self.time.to_dict(), "fits": self.fits,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


@dataclass
class Advice:
    spec: ModelSpec
    setup: Setup
    cluster: Cluster
    ranked: list[Evaluated] = field(default_factory=list)     # fitting, fastest first
    rejected: list[Evaluated] = field(default_factory=list)   # evaluated but too big
    considered: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster) -> Evaluated:
    mem = memory(spec, cand, setup, **cluster.memory_terms(cand.plan))
    t = step_time(spec, cand, setup, cluster)
    host_ok = mem.host * cluster.gpus_per_node <= cluster.host_mem
    fits = mem.total <= cluster.usable_mem and host_ok
    tokens = setup.global_batch * spec.seq / t.total
    mfu = model_flops(spec, setup.global_batch) / (t.total * cluster.world * cluster.peak_flops)
    return Evaluated(cand, mem, t, fits, tokens, mfu)


def _layouts(spec: ModelSpec, setup: Setup, cluster: Cluster):
    """(dp, pp, tp, cp) covering the world."""
    world = cluster.world
    for tp in divisors(cluster.gpus_per_node):
        if spec.heads % tp or world % tp:
            continue
        for cp in divisors(cluster.gpus_per_node // tp):
            if world % (tp * cp) or not cp_styles(spec, cp, tp):
                continue
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > spec.layers or setup.global_batch % dp:
                    continue
                yield dp, pp, tp, cp


def _micro_batches(setup: Setup, dp: int) -> list[int]:
    per_replica = setup.global_batch // dp
    if setup.micro_batch:
        return [setup.micro_batch] if per_replica % setup.micro_batch == 0 else []
    return [b for b in (1, 2, 4, 8, 16) if per_replica % b == 0]


def _schedules(spec: ModelSpec, pp: int, m: int):
    if pp == 1:
        yield "1f1b", 1
        return
    yield "gpipe", 1
    yield "1f1b", 1
    # interleaved needs m a multiple of p and l a multiple of p v (Megatron 2021 §2.2.2)
    for v in (2, 4):
        if m % pp == 0 and spec.layers % (pp * v) == 0:
            yield "interleaved", v


def candidates_for(spec: ModelSpec, setup: Setup, cluster: Cluster):
    """Yield groups of candidates that differ only in offload/recomputation, cheapest first."""
    recomputes = [setup.recompute] if setup.recompute else list(RECOMPUTE)
    # a mixture's experts stay whole over tp and route whole sequences: no sequence
    # parallel for it (models/moe.py refuses it)
    sp = setup.sequence_parallel and not spec.experts
    for dp, pp, tp, cp in _layouts(spec, setup, cluster):
        for b in _micro_batches(setup, dp):
            if cp > 1 and not setup.micro_batch and b % cp == 0:
                continue   # the same as dp x cp replicas of b / cp sequences, less cp's exchange
            m = setup.global_batch // (dp * b)
            for (schedule, v), style, ep in product(_schedules(spec, pp, m),
                                                    cp_styles(spec, cp, tp), ep_sizes(spec, dp)):
                zeros = (0, 1, 3) if pp > 1 else (0, 1, 2, 3)
                for zero in zeros:
                    # ZeRO shards over dp x cp (the ranks that hold the same parameters)
                    if zero and dp * cp == 1 and zero < 3:
                        continue  # nothing to shard; ZeRO with dp = 1 only as a host for offload
                    offloads = ("none", "cpu") if zero else ("none",)
                    if zero == 3 and dp * cp == 1:
                        offloads = ("cpu",)   # one rank: ZeRO-3 shards nothing, only offloads
                    # ZeRO-3 under stages: kept a step (fewer bytes) or regathered (less memory)
                    for regather in (False, True) if zero == 3 and pp > 1 else (False,):
                        group = []
                        for balance, offload, rc in product(stage_balances(spec, pp, v),
                                                            offloads, recomputes):
                            plan = Plan(dp=dp, pp=pp, tp=tp, cp=cp, cp_style=style, ep=ep,
                                        zero=zero, offload=offload, microbatches=m,
                                        schedule=schedule, virtual_stages=v,
                                        precision=setup.precision, zero3_regather=regather,
                                        stage_balance=balance)
                            if runnable(plan):
                                group.append(Candidate(plan, b, rc, sp))
                        if group:
                            yield group


def runnable(plan: Plan) -> bool:
    """Whether meshtrain can run `plan` (core/admit.check_plan): the advice ranks only plans
    that `meshtrain train` and `plan --verify` take."""
    try:
        check_plan(plan)
    except PlanError:
        return False
    return True


def advise(spec: ModelSpec, setup: Setup, cluster: Cluster) -> Advice:
    """Every fitting plan ranked by predicted step time (simpler plans first on ties)."""
    advice = Advice(spec, setup, cluster)
    for group in candidates_for(spec, setup, cluster):
        # Balanced by parameters only where no compute-balanced variant fits: it holds less
        # on the fullest rank, at a slower step.
        for balance in dict.fromkeys(cand.plan.stage_balance for cand in group):
            best = _fastest_fitting([c for c in group if c.plan.stage_balance == balance],
                                    advice)
            if best:
                advice.ranked.append(best)
                break
    advice.ranked.sort(key=_rank_key)
    return advice


def _fastest_fitting(variants: list[Candidate], advice: Advice) -> Evaluated | None:
    """The fastest of `variants` that fits (the misfits kept as rejected). The first (no
    offload, least recomputation) is the fastest of them: when it fits it dominates."""
    fitting = []
    for i, cand in enumerate(variants):
        ev = evaluate(advice.spec, cand, advice.setup, advice.cluster)
        advice.considered += 1
        (fitting if ev.fits else advice.rejected).append(ev)
        if ev.fits and i == 0:
            break
    return min(fitting, key=lambda ev: ev.time.total) if fitting else None


def _rank_key(ev: Evaluated):
    p = ev.cand.plan
    simplicity = (p.offload != "none", p.pp > 1, p.tp > 1, p.zero, p.zero3_regather,
                  ev.cand.recompute != "none", p.stage_balance != "compute", p.cp > 1, p.ep > 1)
    return (round(ev.time.total, 12), simplicity, -ev.cand.micro_batch)


def require_fit(advice: Advice) -> None:
    """Raise NoPlanFits naming the shortfall and what would close it."""
    if advice.ranked:
        return
    spec, setup, cluster = advice.spec, advice.setup, advice.cluster
    if not advice.rejected:
        raise NoPlanFits(
            f"no valid layout of {spec.name} on {cluster.world} devices with global batch "
            f"{setup.global_batch}: the batch must divide among data-parallel replicas and tp "
            f"must divide the {spec.heads} heads and {cluster.gpus_per_node} GPUs per node; "
            f"change --global-batch or --micro-batch")
    best = min(advice.rejected, key=lambda ev: ev.mem.total)
    have = cluster.usable_mem
    psi_bytes = spec.num_params * (setup.param_bytes + setup.grad_bytes + setup.optim_bytes)
    # ZeRO-3 over N devices holds psi_bytes / N of model states (ZeRO Table 1), beside the
    # smallest plan's activations and buffers.
    room = have - best.mem.activations - best.mem.buffers
    if room > 0:
        hints = [f"more devices (ZeRO-3 model states alone need about "
                 f"{int(-(-psi_bytes // room))})"]
    else:
        hints = [f"more devices for tensor or pipeline parallelism (this plan's activations "
                 f"alone, {best.mem.activations / 1e9:.3g} GB, exceed a device)"]
    offloaded = {ev.cand.plan.offload for ev in advice.rejected}
    host_need = best.mem.host * cluster.gpus_per_node
    if "cpu" not in offloaded:
        hints.append("a ZeRO plan with offload to host memory")
    elif host_need > cluster.host_mem:
        hints.append(f"more host memory for offload (needs {host_need / 1e9:,.0f} GB per node, "
                     f"has {cluster.host_mem / 1e9:,.0f} GB)")
    if setup.recompute in ("none", "selective", "attention"):
        hints.append("activation recomputation (--recompute full)")
    if setup.micro_batch > 1:
        hints.append("a smaller --micro-batch")
    hints.append("devices with more memory")
    if best.mem.total <= have:
        where = (f"fits device memory ({best.mem.total / 1e9:.3g} GB of {have / 1e9:.3g} GB) "
                 f"only by offloading {host_need / 1e9:,.0f} GB per node to host memory, more "
                 f"than its {cluster.host_mem / 1e9:,.0f} GB")
    else:
        where = (f"needs {best.mem.total / 1e9:.3g} GB per device against {have / 1e9:.3g} GB "
                 f"usable ({best.mem.model_states / 1e9:.3g} GB model states, "
                 f"{best.mem.activations / 1e9:.3g} GB activations)")
    raise NoPlanFits(
        f"{spec.name} fits no plan on {cluster.nodes} x {cluster.gpus_per_node} devices: the "
        f"smallest, {best.cand.label()}, {where}. To fit, try: " + "; ".join(hints))
