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
    """A sentence proposing `mode` (sync every `sync_every` steps) in place of `best`'s DDP
    when its dp axis crosses nodes over a link slower than the crossover at which DDP's step
    takes WORTH times the local-step mode's, and the fastest plan (`top_time` seconds) is
    slower than that too; None otherwise."""
    p = best.plan
    if mode not in LOCAL_STEP_MODES or p.dp_mode != "ddp" or p.zero or p.pp > 1 or p.dp < 2:
        return None
    if p.dp * p.tp <= cluster.gpus_per_node or cluster.curves_replace_links:
        return None
    local = replace(best, plan=Plan(dp=p.dp, tp=p.tp, microbatches=p.microbatches,
                                    dp_mode=mode, sync_every=sync_every))
    bw = crossover_bandwidth(spec, setup, cluster, best, local, WORTH)
    if cluster.inter_bw >= bw:
        return None
    t_ddp = _time(spec, best, setup, cluster, cluster.inter_bw)
    t_loc = _time(spec, local, setup, cluster, cluster.inter_bw)
    if top_time < WORTH * t_loc:   # another plan already comes close without the caveat
        return None
    return (f"the dp axis crosses a {cluster.inter_bw * 8 / 1e9:.3g} Gb/s inter-node link, "
            f"below the {bw * 8 / 1e9:.3g} Gb/s at which DDP's step takes {WORTH}x as long for this "
            f"model: consider "
            f"dp_mode={mode!r}, sync_every={sync_every} ({t_loc * 1e3:.4g} ms/step predicted "
            f"against DDP's {t_ddp * 1e3:.4g} ms); {QUALITY_CAVEAT}")


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


def matrix_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """The model's weight matrices (rows, cols) from its spec: q, k, v, o and the MLP's per
    block (q, k, v apart: a fused qkv module compresses as one h x (h + 2 kv) matrix),
    the token and position embeddings, and the head if untied."""
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_dim
    block = [(h, h), (h, kv), (h, kv), (h, h)] + [(h, f)] * (3 if spec.mlp == "swiglu" else 2)
    rest = [(spec.vocab, h)] + ([(spec.seq, h)] if spec.learned_pos else [])
    return block * spec.layers + rest + ([] if spec.tied else [(spec.vocab, h)])


def powersgd_dp_bytes(spec: ModelSpec, setup: Setup, dp: int, rank: int) -> float:
    """Bytes one rank sends per step under PowerSGD (Vogels et al. 2019, Alg. 1) at `rank`:
    each M x N gradient matrix all-reduces P (M x r) and Q (N x r), (M + N) r numbers,
    unless that is no smaller than M N; vectors (biases, norms) go uncompressed. Ring share
    2(dp-1)/dp as DDP's (axis_bytes)."""
    shapes = matrix_shapes(spec)
    sent = sum(min((m + n) * rank, m * n) for m, n in shapes)
    vectors = spec.num_params - sum(m * n for m, n in shapes)
    return 2 * (dp - 1) / dp * (sent + vectors) * setup.grad_bytes
