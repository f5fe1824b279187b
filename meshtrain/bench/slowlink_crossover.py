"""Time to a common loss over a slow link, measured and predicted from the same inputs.

A run's wall-clock to its first evaluation at or below a target loss, over N steps, is
    T(B) = C + S / B        C = sum of (step seconds - bytes sent / B_run), S = bytes sent
since the emulated link charges each call latency steps + bytes / bandwidth (core/link.py):
C holds the compute and the latency terms, S / B the bandwidth term, both from the run's
own per-step records. DDP and a method take equal time to the target at
    B* = (S_ddp - S) / (C - C_ddp)          (inf: the method is faster at every bandwidth).

The planner answers the same question with its time model: `crossover_bandwidth` with
gain = (N - K) / (N_ddp - K) (K: the method's warm-up steps, which are DDP's), on a cluster
of one rank per node whose link is the emulated one; each plan's compute is its own measured
mean step (the method's after its warm-up) less the link time the planner itself predicts
for it (no FLOP model involved). So both sides share the measured compute, and what is
compared is the planner's link model (bytes, latency steps, one sync per H) against the
emulated link's charges.
"""
from __future__ import annotations

import math

from meshtrain.core.plan import Plan
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.slowlink import CrossoverError, crossover_bandwidth
from meshtrain.planner.time_model import step_time


def reach(row: dict, target: float) -> tuple[int, float, float, float] | None:
    """(steps, seconds, C, S) up to the first evaluation at or below `target`; None if
    no evaluation is."""
    for step, seconds, val in row["evals"]:
        if val <= target:
            done = row["records"][:step]
            return step, seconds, sum(c for c, _ in done), sum(s for _, s in done)
    return None


def measured_crossover(ddp: tuple, method: tuple) -> float:
    """Bytes/s at which both reach the target at the same time (see the module's doc)."""
    (_, _, c_ddp, s_ddp), (_, _, c, s) = ddp, method
    if s >= s_ddp:
        return 0.0
    return (s_ddp - s) / (c - c_ddp) if c > c_ddp else math.inf


def plan_of(flags: list[str], nproc: int) -> Plan:
    """The Plan a bench method's `meshtrain train` flags describe (the flags it uses)."""
    opts = dict(zip(flags[::2], flags[1::2]))
    mode = opts.get("--dp-mode", "ddp")
    kw = dict(dp=nproc, dp_mode=mode, sync_warmup_steps=int(opts.get("--sync-warmup-steps", 0)))
    if mode != "ddp":
        kw["sync_every"] = int(opts["--sync-every"])
    for flag, field in (("--outer-lr", "outer_lr"), ("--outer-momentum", "outer_momentum")):
        if flag in opts:
            kw[field] = float(opts[flag])
    if "--compression" in opts:
        kw.update(compression=opts["--compression"],
                  compression_rank=int(opts["--compression-rank"]))
    return Plan(**kw)


def planner_crossover(model: str, nproc: int, batch: int, bandwidth: float, latency: float,
                      ddp_step_s: float, method_step_s: float, plan: Plan,
                      gain: float) -> float | None:
    """The planner's crossover for `plan` against DDP at `gain`, each plan's compute
    anchored on its measured mean step at `bandwidth`; None where the planner does not
    price `plan` (PowerSGD is not in its time model)."""
    if plan.compression != "none" or gain <= 0:
        return None
    spec = preset(model)
    setup = Setup(global_batch=batch, micro_batch=batch // nproc, precision="fp32",
                  optimizer="adam", recompute="none")
    ddp = Candidate(Plan(dp=nproc), micro_batch=batch // nproc)
    method = Candidate(plan, micro_batch=batch // nproc)
    # one rank per node: the dp axis is the emulated link; arithmetic costs nothing in the
    # model, the measured compute is the fixed cost of a step
    free = Cluster(nodes=nproc, gpus_per_node=1, inter_bw=bandwidth, inter_latency=latency,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0, name="emulated")
    anchored = [free.with_(step_overhead=max(0.0, measured - step_time(
        spec, cand, setup, free).total)) for cand, measured in ((ddp, ddp_step_s),
                                                                (method, method_step_s))]
    try:
        return crossover_bandwidth(spec, setup, anchored[0], ddp, method, gain, anchored[1])
    except CrossoverError:
        return None
