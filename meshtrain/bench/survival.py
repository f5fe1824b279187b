"""Runs that lose a rank: kill -9 one rank at a step, or while it writes a checkpoint, under
`meshtrain train --max-restarts 1`, and compare the final parameters with the same run
uninterrupted (bit for bit).

    meshtrain bench survival --runs 10      # 10 kills at a step, 10 in a checkpoint

Each run is a real `meshtrain train` command in its own process tree (the elastic agent does
the restart); the fault is injected through MESHTRAIN_INJECT_FAULT (train/faults.py).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# every plan that exists, on 2 ranks (the fault lands on a random one of them)
PLANS = {
    "ddp": [],
    "zero1": ["--zero", "1"],
    "zero2": ["--zero", "2"],
    "zero3": ["--zero", "3"],
    "tp": ["--tp", "2"],
    "pp": ["--pp", "2", "--microbatches", "2"],
}
STEPS, CKPT_EVERY, WORLD = 6, 2, 2
SHAPE = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "8",
         "--eval-every", "100", "--no-progress", "--check-collectives"]


@dataclass
class Outcome:
    plan: str
    fault: str            # RANK:STEP[:checkpoint]
    exit_code: int
    resumed_from: int | None
    bit_equal: bool
    log: str


def train(run_dir: Path, data: Path, plan: str, fault: str | None = None,
          timeout_s: float = 120) -> tuple[int, str]:
    env = dict(os.environ)
    env.pop("MESHTRAIN_INJECT_FAULT", None)
    if fault:
        env["MESHTRAIN_INJECT_FAULT"] = fault
    cmd = [sys.executable, "-m", "meshtrain.cli.main", "train", "--nproc", str(WORLD),
           "--data", str(data), "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
           "--run-dir", str(run_dir), "--max-restarts", "1", *SHAPE, *PLANS[plan]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:   # a hang is a failure: take its whole process tree down
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out + f"\n(killed after {timeout_s} s: the run hung)"
    return proc.returncode, out


def final_parameters(run_dir: Path) -> dict:
    from meshtrain.train.generate import load_trained

    model, _, _ = load_trained(run_dir)
    return model.state_dict()


def same_bits(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def random_fault(rng: random.Random, in_checkpoint: bool) -> str:
    rank = rng.randrange(WORLD)
    if in_checkpoint:   # a checkpoint before the last (the last one ends the run)
        return f"{rank}:{rng.randrange(CKPT_EVERY, STEPS, CKPT_EVERY)}:checkpoint"
    return f"{rank}:{rng.randrange(1, STEPS)}"


def run_cases(cases: list[tuple[str, str]], workdir: Path, progress=None) -> list[Outcome]:
    """(plan, fault) pairs; each plan's uninterrupted run is made once, as the reference."""
    import json

    data = workdir / "data.txt"
    if not data.exists():   # a small, fixed text: this module's own source, repeated
        data.write_text(Path(__file__).read_text() * 8)
    references, outcomes = {}, []
    for i, (plan, fault) in enumerate(cases):
        if plan not in references:
            code, log = train(workdir / f"{plan}-reference", data, plan)
            if code:
                raise RuntimeError(f"the uninterrupted {plan} run failed:\n{log}")
            references[plan] = final_parameters(workdir / f"{plan}-reference")
        run_dir = workdir / f"{plan}-{i}"
        code, log = train(run_dir, data, plan, fault)
        summary = run_dir / "summary.json"
        resumed = json.loads(summary.read_text())["resumed_from"] if summary.exists() else None
        equal = code == 0 and same_bits(final_parameters(run_dir), references[plan])
        outcomes.append(Outcome(plan, fault, code, resumed, equal, log))
        if progress:
            progress(f"{plan:6s} kill {fault:16s} exit {code}, resumed from step {resumed}, "
                     f"bit-equal: {equal}")
    return outcomes


def run(runs: int, seed: int, progress=None) -> list[Outcome]:
    """`runs` kills at a random step and `runs` during a checkpoint write, plans in turn."""
    rng = random.Random(seed)
    names = list(PLANS)
    cases = [(names[i % len(names)], random_fault(rng, False)) for i in range(runs)]
    cases += [(names[i % len(names)], random_fault(rng, True)) for i in range(runs)]
    with tempfile.TemporaryDirectory(prefix="meshtrain-survival-") as tmp:
        return run_cases(cases, Path(tmp), progress=progress)


def format_report(outcomes: list[Outcome]) -> str:
    lines = []
    for kind, where in (("at a step", False), ("during a checkpoint", True)):
        mine = [o for o in outcomes if o.fault.endswith(":checkpoint") == where]
        good = sum(o.bit_equal for o in mine)
        lines.append(f"killed {kind}: {good}/{len(mine)} finished bit-equal to the "
                     f"uninterrupted run")
    return "\n".join(lines)
