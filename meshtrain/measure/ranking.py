"""`meshtrain plan --verify --rank`: is the planner's order of plans the measured order?

For a meshtrain GPT (verify's, or the one `--model` names) at one world size, the advisor
ranks every plan that fits the calibrated machine. The planner's top plans and a seeded
sample of the rest (plans the Trainer runs) are run for real by `verify` (interleaved
rounds, medians); the report gives the Spearman rank correlation between predicted and
measured step times, and whether the predicted best was the measured best, or how far
behind it was.
"""
from __future__ import annotations

import dataclasses
import io
import json
import random
import sys

from meshtrain.core.admit import check_plan
from meshtrain.core.plan import PlanError
from meshtrain.measure.probe import local_kind
from meshtrain.measure.trained_model import TrainedModel, spec_of
from meshtrain.measure.verify import MODEL, ROUNDS, verify
from meshtrain.planner.advisor import advise
from meshtrain.planner.profile import cluster_from_profile, load_profile
from meshtrain.planner.setup import Setup


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their average rank)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two equally long lists of at least 2 values")
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def runnable(cand) -> bool:
    """Plans `verify` can run and measure fairly: the Trainer builds them, without sequence
    parallel (the ranking's setup leaves it off: one tp variant per plan) and without
    offload (disk speed is not calibrated)."""
    if cand.sp or cand.plan.offload != "none":
        return False
    try:
        check_plan(cand.plan)
    except PlanError:
        return False
    return True


def as_verify_plan(cand, global_batch: int) -> tuple[dict, int]:
    """(Plan fields, per-rank batch) in verify's form, for one advisor candidate."""
    per_rank = global_batch // cand.plan.dp
    plan = dataclasses.replace(cand.plan, microbatches=per_rank // cand.micro_batch,
                               recompute=cand.recompute, sequence_parallel=False)
    defaults = type(plan)()
    fields = {k: v for k, v in plan.to_dict().items() if v != getattr(defaults, k)}
    return fields, per_rank


def choose_plans(profile: dict, world: int, global_batch: int = 16, top: int = 3,
                 others: int = 9, seed: int = 0, model: dict | TrainedModel = MODEL
                 ) -> list[tuple[dict, int]]:
    """The advisor's `top` fastest runnable plans and `others` drawn from the rest, one from
    each of `others` equal slices of its predicted order, so the sample spans the range.
    (Six top plans, as first built, were dp x pp variants predicted within 1-2% of each
    other, closer than this machine's run-to-run noise: their measured order was chance,
    and the correlation over them measured the noise; the predicted best's distance from
    the measured best still judges the top.)"""
    spec = spec_of(model)
    setup = Setup(global_batch=global_batch, micro_batch=0, precision="fp32",
                  optimizer="adam", recompute="", sequence_parallel=False)
    ranked = [ev.cand for ev in advise(spec, setup, cluster_from_profile(profile, world)).ranked
              if runnable(ev.cand)]
    rest = ranked[top:]
    rng = random.Random(seed)
    n = min(others, len(rest))
    chosen = ranked[:top] + [rest[rng.randrange(i * len(rest) // n, (i + 1) * len(rest) // n)]
                             for i in range(n)]
    return [as_verify_plan(c, global_batch) for c in chosen]


def rank_report(rows: list[dict]) -> tuple[dict, str]:
    """Spearman over the rows' predicted and measured step times, and the predicted best."""
    predicted = [r["predicted"]["step"] for r in rows]
    measured = [r["measured"]["step"] for r in rows]
    rho = spearman(predicted, measured)
    best_predicted = min(range(len(rows)), key=predicted.__getitem__)
    best_measured = min(range(len(rows)), key=measured.__getitem__)
    behind = measured[best_predicted] / measured[best_measured] - 1
    place = sorted(measured).index(measured[best_predicted]) + 1
    result = {"spearman": rho, "plans": len(rows), "predicted_best": rows[best_predicted]["plan"],
              "measured_best": rows[best_measured]["plan"], "behind": behind,
              "measured_place": place}
    text = (f"rank correlation (Spearman) of predicted vs measured step time over {len(rows)} "
            f"plans: {rho:.3f}\npredicted best: {result['predicted_best']} — measured "
            + ("best too" if best_predicted == best_measured else
               f"#{place}, {behind:.1%} behind the measured best ({result['measured_best']})"))
    return result, text


def rank_command(args, model: dict | TrainedModel | None = None) -> int:
    """`meshtrain plan --verify --rank` on `model` (GPTConfig's fields or a model `train`
    builds; None: verify's GPT)."""
    model = model or MODEL
    profile = load_profile(args.profile, local_kind())
    plans = choose_plans(profile, args.nproc, model=model)
    if len(plans) < 2:
        raise ValueError(f"only {len(plans)} runnable plan(s) at {args.nproc} ranks: nothing to "
                         "rank; try a larger --nproc")
    print(f"ranking {len(plans)} plans at {args.nproc} ranks: the planner's top "
          f"{min(3, len(plans))} and a sample across the rest", file=sys.stderr)
    table = io.StringIO()
    rows = verify(profile, plans=plans, out=table, model=model, rounds=args.rounds or ROUNDS,
                  progress=True)
    print(table.getvalue(), end="")
    result, text = rank_report(rows)
    print("\n" + text)
    if args.json:
        print(json.dumps({"rows": rows, "ranking": result}, indent=2))
    return 0
