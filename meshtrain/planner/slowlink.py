"""Slow data-parallel links: the bandwidth below which syncing every H steps (DiLoCo /
local SGD) beats DDP's every-step all-reduce, and the advice that follows from it.

The time model's step time is compute + (exposed) dp traffic, and dp traffic falls with the
link's bandwidth; the crossover is the inter-node bandwidth at which both plans' predicted
step times are equal, found by bisection on a log scale (both curves are monotone in it).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from meshtrain.core.plan import LOCAL_STEP_MODES, Plan
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.time_model import step_time

# DDP's every-step sync any exposed traffic makes slower than a local-step mode at any
# bandwidth; fewer syncs can cost quality, so advise them only for a material gain
WORTH = 1.25
# The quality caveat quotes docs/diloco.md (tiny GPT, 4 ranks, 256 steps, equal tokens).
QUALITY_CAVEAT = ("fewer syncs can cost validation loss: measured +2.4% (diloco, H = 8, "
                  "outer momentum 0.5, after 64 DDP steps of 256) to +23.3% (outer momentum "
                  "0.9, no DDP warm-up) against DDP at equal tokens on a tiny GPT "
                  "(docs/diloco.md); measure on your model before switching")
POWERSGD_CAVEAT = ("compressed gradients can cost validation loss: PowerSGD at rank 4 measured "
                   "+0.9% with SGD and momentum and +6-7% with AdamW against DDP at equal "
                   "tokens on a tiny GPT (docs/powersgd.md); measure on your model before "
                   "switching")
PSGD_RANK = 4   # the rank the advice proposes (rank 1 measured +13.6%: docs/powersgd.md)
LOW, HIGH = 1e3, 1e14   # bytes/s searched: 8 kb/s to 800 Tb/s


class CrossoverError(ValueError):
    """A crossover that cannot be computed: the message names why and the fix."""


def _time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster, bw: float) -> float:
    return step_time(spec, cand, setup, cluster.with_(inter_bw=bw)).total


def crossover_bandwidth(spec: ModelSpec, setup: Setup, cluster: Cluster, cand_a: Candidate,
                        cand_b: Candidate, gain: float = 1.0,
                        cluster_b: Cluster | None = None) -> float:
    """Inter-node bytes/s at which `cand_a` (e.g. DDP) takes `gain` times the predicted step
    time of `cand_b` (e.g. DiLoCo, H); gain 1: equal step times. Below it `cand_b` is faster
    by more than `gain`; 0.0 if it never is, math.inf if it always is (8 kb/s .. 800 Tb/s).
    `cluster_b` (default `cluster`): `cand_b`'s own calibration where it differs (a
    benchmark's measured step of each plan)."""
    other = cluster if cluster_b is None else cluster_b
    for c in (cand_a, cand_b):
        if c.plan.tp * c.plan.dp <= cluster.gpus_per_node:
            raise CrossoverError(
                f"{c.label()} keeps its dp axis inside one node ({cluster.gpus_per_node} GPUs "
                "per node): no inter-node link to vary; use more dp ranks or nodes")
    if cluster.curves_replace_links or other.curves_replace_links:
        raise CrossoverError("a calibrated cluster's measured collective curves replace "
                             "the link figure; compute the crossover on a preset cluster")
    return equal_time_bandwidth(lambda bw: _time(spec, cand_a, setup, cluster, bw),
                                lambda bw: gain * _time(spec, cand_b, setup, other, bw))


def equal_time_bandwidth(time_a: Callable[[float], float],
                         time_b: Callable[[float], float]) -> float:
    """Bytes/s at which `time_b(bw)` equals `time_a(bw)`, both non-increasing in bw with
    time_a falling faster (a sends more bytes): below it b takes less time. 0.0 if b never
    does, math.inf if it always does (8 kb/s .. 800 Tb/s); bisection on a log scale."""
    diff = lambda bw: time_a(bw) - time_b(bw)
    lo, hi = LOW, HIGH
    if diff(hi) > 0:
        return math.inf
    if diff(lo) <= 0:
        return 0.0
    for _ in range(200):   # diff > 0 at lo (b faster), <= 0 at hi
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if diff(mid) > 0 else (lo, mid)
        if hi / lo < 1 + 1e-12:
            break
    return math.sqrt(lo * hi)


def slow_link_advice(spec: ModelSpec, setup: Setup, cluster: Cluster, best: Candidate,
                     sync_every: int = 32, mode: str = "diloco",
                     top_time: float = math.inf) -> str | None:
    """A sentence proposing, in place of `best`'s DDP whose dp axis crosses nodes, `mode`
    (sync every `sync_every` steps) and PowerSGD at rank 4, each where the link is slower
    than the crossover at which DDP's step takes WORTH times the method's and the fastest
    plan (`top_time` seconds) is slower than that too; None where neither is."""
    p = best.plan
    if mode not in LOCAL_STEP_MODES or p.dp_mode != "ddp" or p.zero or p.pp > 1 or p.dp < 2:
        return None
    if p.dp * p.tp <= cluster.gpus_per_node or cluster.curves_replace_links:
        return None
    local = replace(best, plan=Plan(dp=p.dp, tp=p.tp, microbatches=p.microbatches,
                                    dp_mode=mode, sync_every=sync_every))
    options = [(f"dp_mode={mode!r}, sync_every={sync_every}", local, setup, QUALITY_CAVEAT)]
    if p.tp == 1:   # meshtrain's PowerSGD is DDP's, in fp32: its step is priced in fp32
        options.append((f"compression='powersgd', compression_rank={PSGD_RANK} (fp32)",
                        replace(best, plan=Plan(dp=p.dp, microbatches=p.microbatches,
                                                compression="powersgd",
                                                compression_rank=PSGD_RANK)),
                        replace(setup, precision="fp32"), POWERSGD_CAVEAT))
    t_ddp = _time(spec, best, setup, cluster, cluster.inter_bw)
    clauses = []
    for name, cand, its_setup, caveat in options:
        t = lambda bw: _time(spec, cand, its_setup, cluster, bw)
        bw = equal_time_bandwidth(lambda b: _time(spec, best, setup, cluster, b),
                                  lambda b: WORTH * t(b))
        t_here = t(cluster.inter_bw)
        if cluster.inter_bw < bw and top_time >= WORTH * t_here:   # no plan comes close
            clauses.append(f"{name} ({t_here * 1e3:.4g} ms/step predicted; DDP's step takes "
                           f"{WORTH}x as long below {bw * 8 / 1e9:.3g} Gb/s): {caveat}")
    if not clauses:
        return None
    return (f"the dp axis crosses a {cluster.inter_bw * 8 / 1e9:.3g} Gb/s inter-node link, "
            f"where DDP takes {t_ddp * 1e3:.4g} ms/step for this model: consider "
            + "; or ".join(clauses))


def slow_link_note(advice) -> str | None:
    """The advice for the fastest ranked DDP plan whose dp axis crosses nodes (the top plan
    may keep dp inside a node and pipeline across it), beside the top plan's step time."""
    cl = advice.cluster
    for ev in advice.ranked:
        top = advice.ranked[0]
        note = slow_link_advice(advice.spec, advice.setup, cl, ev.cand,
                                top_time=top.time.total)
        if note:
            return (f"for {ev.cand.label()}, {note} (the top plan, {top.cand.label()}, "
                    f"{top.time.total * 1e3:.4g} ms/step)")
    return None
