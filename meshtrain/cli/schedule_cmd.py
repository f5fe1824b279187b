"""`meshtrain schedule`: a pipeline schedule's theoretical timeline, simulated from its
action lists (the ones the runtime executes), drawn and printed with its bubble fraction.

    meshtrain schedule --pp 4 --microbatches 8 --schedule 1f1b
    meshtrain schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2 \\
        --out interleaved.png
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshtrain.core.plan import SCHEDULES


def add_parser(sub) -> None:
    p = sub.add_parser("schedule", help="draw a pipeline schedule's timeline and its bubble",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="chunks per rank (interleaved only)")
    p.add_argument("--forward-cost", type=float, default=1.0,
                   help="time of one stage's forward (default 1)")
    p.add_argument("--backward-cost", type=float, default=2.0,
                   help="time of one stage's backward (default 2: two matmuls per forward one)")
    p.add_argument("--out", help="the PNG to write (default schedule-<schedule>.png)")
    p.set_defaults(run=run)


def run(args) -> int:
    from meshtrain.core.plan import Plan, PlanError
    from meshtrain.report.timeline import draw_timeline, text_timeline
    from meshtrain.strategies.pipeline.schedules import bubble_formula, build_schedule
    from meshtrain.strategies.pipeline.simulator import simulate

    try:
        if args.pp < 2:
            raise PlanError(f"--pp {args.pp}: a pipeline needs at least 2 ranks")
        if args.forward_cost <= 0 or args.backward_cost <= 0:
            raise PlanError("--forward-cost and --backward-cost must be positive")
        plan = Plan(pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
                    virtual_stages=args.virtual_stages)
        out = Path(args.out or f"schedule-{plan.schedule}.png")
        if out.suffix.lower() != ".png":
            raise PlanError(f"--out {out}: give a file name ending in .png")
        if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise PlanError(f"--out {out}: {out.parent} is not a writable folder")
    except PlanError as exc:
        print(f"meshtrain schedule: {exc}", file=sys.stderr)
        return 2
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    timeline = simulate(build_schedule(plan.schedule, p, m, v), args.forward_cost,
                        args.backward_cost, v)
    theory, formula = bubble_formula(plan.schedule, p, m, v)
    title = (f"{plan.schedule}  P={p} M={m}" + (f" V={v}" if v > 1 else "")
             + f"  bubble {timeline.bubble:.4f}")
    draw_timeline(timeline, title, v).savefig(out, dpi=100)
    print(text_timeline(timeline, v))
    print(f"bubble        {timeline.bubble:.4f} simulated, {formula} = {theory:.4f} "
          f"(P={p}, M={m}" + (f", V={v}" if v > 1 else "") + ")")
    print(f"timeline      {out}")
    return 0
