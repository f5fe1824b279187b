"""Time to a common loss over a slow link, measured and predicted from the same inputs.

A run's wall-clock to the step n at which its validation loss crosses a target is
    T(B) = C + S / B        C = sum of (step seconds - bytes sent / B_run), S = bytes sent
over its first n steps (warm-up steps included), since the emulated link charges each call
latency steps + bytes / bandwidth (core/link.py): C holds the compute and the latency
terms, S / B the bandwidth term, both from the run's own per-step records. n is
interpolated linearly in the loss between the last evaluation above the target and the
first at or below it (the partial step counted by its fraction), so that it is not
quantised to the evaluation interval. DDP and a method take equal time to the target at
    B* = (S_ddp - S) / (C - C_ddp)          (inf: the method is faster at every bandwidth).

The planner answers the same question from the same steps: each run's measured compute over
its n steps (step seconds less what the emulated link slept, `link_s`) plus, for each of
those steps, the link time its time model predicts at B (the method's first K warm-up steps
DDP's, after them one sync per H amortised per step), on a cluster of one rank per node
whose link is the emulated one (`planner_crossover_at_target`). So both sides share the
measured compute and the steps, and what is compared is the planner's link model (bytes,
latency steps, one sync per H) against the emulated link's charges.
"""
from __future__ import annotations

import math

from meshtrain.core.plan import Plan
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.slowlink import HIGH, equal_time_bandwidth
from meshtrain.planner.time_model import step_time


def reach(row: dict, target: float, interpolate: bool = False
          ) -> tuple[float, float, float, float] | None:
    """(steps, seconds, C, S) up to the first evaluation at or below `target`; None if no
    evaluation is. `interpolate`: up to the step at which the loss, linear between that
    evaluation and the one before it, crosses `target` (fractional; the module's doc)."""
    before = None
    for step, seconds, val in row["evals"]:
        if val <= target:
            if interpolate and before is not None:
                (s0, v0), span = before, step - before[0]
                step = s0 + span * (v0 - target) / (v0 - val)
                seconds = upto(row["step_s"], step)
            return (step, seconds, upto([c for c, *_ in row["records"]], step),
                    upto([s for _, s, *_ in row["records"]], step))
        before = (step, val)
    return None


def upto(values: list[float], steps: float) -> float:
    """Sum of the first `steps` values, a fractional last one counted by its fraction."""
    whole = math.floor(steps)
    part = (steps - whole) * values[whole] if whole < len(values) else 0.0
    return sum(values[:whole]) + part


def measured_crossover(ddp: tuple, method: tuple) -> float:
    """Bytes/s at which both reach the target at the same time (see the module's doc)."""
    (c_ddp, s_ddp), (c, s) = ddp[2:4], method[2:4]
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


def _priced(model: str, nproc: int, batch: int, seq: int | None, latency: float):
    """The planner's view of the bench: the model's spec, the setup, DDP's candidate, and a
    cluster of one rank per node whose dp axis is the emulated link (its bandwidth set where
    a crossover is searched), on which arithmetic costs nothing (the measured compute
    stands for it)."""
    setup = Setup(global_batch=batch, micro_batch=batch // nproc, precision="fp32",
                  optimizer="adam", recompute="none")
    free = Cluster(nodes=nproc, gpus_per_node=1, inter_bw=HIGH, inter_latency=latency,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0, name="emulated")
    return preset(model, seq), setup, Candidate(Plan(dp=nproc), micro_batch=batch // nproc), free


def planner_crossover_at_target(model: str, nproc: int, batch: int, seq: int | None,
                                latency: float,
                                plan: Plan, ddp: tuple[float, float],
                                method: tuple[float, float]) -> float:
    """Bytes/s below which the planner predicts `plan` reaches the target sooner than DDP;
    `ddp`, `method`: (steps to the target, measured compute over them in seconds). Each
    run's predicted time is its compute plus the planner's link time at B for every step
    it took (the module's doc)."""
    spec, setup, ddp_cand, free = _priced(model, nproc, batch, seq, latency)
    cand = Candidate(plan, micro_batch=ddp_cand.micro_batch)
    link = lambda c, bw: step_time(spec, c, setup, free.with_(inter_bw=bw)).total
    k, (n_ddp, c_ddp), (n, c) = plan.sync_warmup_steps, ddp, method
    return equal_time_bandwidth(
        lambda bw: c_ddp + n_ddp * link(ddp_cand, bw),
        lambda bw: c + min(n, k) * link(ddp_cand, bw) + max(0.0, n - k) * link(cand, bw))
