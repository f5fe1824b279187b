"""`meshtrain plan --verify [--model NAME]`: verify's plans (measure/verify.py) on this
machine, on verify's own GPT or the model given, those its profile can price and that are
predicted to fit, then the table, each quantity's worst error against its limit, and the
plans a rank refused or failed."""
from __future__ import annotations

import io
import json
import sys

from meshtrain.core.device import gpu_count, resolve_device
from meshtrain.core.units import fmt_duration
from meshtrain.measure.probe import local_kind
from meshtrain.measure.runs import VERIFY_GPTS, run_plan
from meshtrain.measure.trained_model import TrainedModel, describe
from meshtrain.measure.verify import (BUILDING, GPU_LIMITS, LEGEND, LIMITS, PLANS, ROUNDS,
                                      STEPS, WARMUP,
                                      header, label, predict, profile_world,
                                      runs_in_its_precision, summary, verify, waits_for_strategy,
                                      world_of)
from meshtrain.planner.hardware import HardwareError
from meshtrain.planner.profile import load_profile, profile_path


def verify_command(args, model: dict | TrainedModel | None = None) -> int:
    """`model`: GPTConfig's fields or a model `meshtrain train` builds; None: the device's
    own verify GPT."""
    kind = local_kind()
    profile = load_profile(args.profile, kind)
    device = resolve_device()
    model = model or VERIFY_GPTS[device]
    plans, predicted, too_big, waiting = _plans(args, profile, kind, device, model)
    rounds = args.rounds or ROUNDS
    steps = rounds * (WARMUP + STEPS) + 1   # the first round's one more, for exact counts
    seconds = steps * sum(ev.time.total for ev in predicted)
    fp32 = fp32_only(device)
    left_out = "".join(f"; {n} {why}" for n, why in (
        (len(PLANS + BUILDING) - len(plans) - len(too_big) - fp32 - len(waiting),
         "need more GPUs"),
        (fp32, "run in fp32 only"), (len(too_big), "predicted not to fit"),
        (len(waiting), "not built yet")) if n)
    print(f"verifying {len(plans)} plans of {describe(model)} (AdamW{left_out}), {rounds} "
          f"round{'s' * (rounds != 1)}, against the profile of {profile['created']}; their "
          f"steps alone are predicted to take {fmt_duration(seconds)}, beside each run's "
          "start", file=sys.stderr)
    if too_big:
        print(f"predicted not to fit: {' | '.join(too_big)}", file=sys.stderr)
    for name, why in waiting:
        print(f"not built yet: {name}: {why}", file=sys.stderr)
    table, failed = io.StringIO(), []
    rows = verify(profile, plans=plans, out=table, model=model, rounds=rounds, progress=True,
                  failed=failed)
    print(header(device))
    print(table.getvalue(), end="")
    ok, text = summary(rows, GPU_LIMITS if device == "cuda" else LIMITS) if rows else (False, "")
    refused = [name for name, by_plan, _ in failed if by_plan]
    crashed = [name for name, by_plan, _ in failed if not by_plan]
    print("\n" + text + "".join(
        f"\n  {what}: {len(names)} plan(s) ({' | '.join(names)})" for what, names in (
            ("refused by the Trainer for this model", refused), ("FAILED", crashed)) if names))
    print(f"{LEGEND[device]}; step = median of the timed steps after the warm-up.")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if ok and not crashed else 1


def fp32_only(device: str) -> int:
    """How many of verify's plans the device's precision leaves out (runs_in_its_precision)."""
    ran = [run_plan(plan, device) for plan, _ in PLANS + BUILDING]
    return sum(not runs_in_its_precision(plan) and not waits_for_strategy(plan) for plan in ran)


def _plans(args, profile: dict, kind: str, device: str, model) -> tuple:
    """(verify's plans this machine runs for `model` and predicts to fit, their predictions,
    the labels of those predicted not to fit, (label, refusal) of those not built yet),
    refusing a profile without the worlds they need and a model none of them is predicted
    to fit, before any rank starts."""
    most = gpu_count() if device == "cuda" else float("inf")   # one rank per GPU
    ran = [(run_plan(plan, device), batch) for plan, batch in PLANS + BUILDING]   # its dtype
    waiting = [(label(*pb), why) for pb in ran if (why := waits_for_strategy(pb[0]))]
    plans = [(plan, batch) for plan, batch in ran if runs_in_its_precision(plan)
             and max(world_of(plan), profile_world(plan)) <= most]
    missing = sorted({profile_world(p) for p, _ in plans} - {int(w) for w in profile["worlds"]})
    if missing:
        raise HardwareError(f"the profile {profile_path(args.profile, kind)} has no measurements at "
                            f"{missing} ranks, which --verify runs; calibrate them with "
                            f"`meshtrain plan --calibrate --nproc {max(missing)}`")
    predicted = [predict(profile, plan, batch, model) for plan, batch in plans]
    too_big = [label(*pb) for pb, ev in zip(plans, predicted) if not ev.fits]
    if len(too_big) == len(plans):
        raise ValueError(f"none of --verify's plans is predicted to fit {describe(model)} on "
                         "this machine: verify a smaller model")
    fitting = [(pb, ev) for pb, ev in zip(plans, predicted) if ev.fits]
    return tuple(pb for pb, _ in fitting), [ev for _, ev in fitting], too_big, waiting
