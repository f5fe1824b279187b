"""Time to first step of `meshtrain train` (`meshtrain bench startup`): from the command's
start until the first step's record reaches metrics.jsonl, measured from outside, so any
installation of meshtrain can be timed. With `--against OTHER/bin/meshtrain`, two
installations alternate run by run (a noisy machine hits both alike); medians are quoted.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def first_step_seconds(meshtrain: list[str], extra: list[str]) -> float:
    run = Path(tempfile.mkdtemp(prefix="meshtrain-startup-")) / "run"
    metrics = run / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen([*meshtrain, "train", "--steps", "2", "--run-dir", str(run),
                             "--no-progress", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            if metrics.exists() and any("loss" in json.loads(line) for line in
                                        metrics.read_text().splitlines() if line.strip()):
                return time.perf_counter() - start
            time.sleep(0.01)
        raise RuntimeError(f"{' '.join(meshtrain)} train exited ({proc.returncode}) before a "
                           f"first step")
    finally:
        proc.wait()
        shutil.rmtree(run.parent, ignore_errors=True)


def run(commands: dict[str, list[str]], runs: int, extra: list[str], progress=None) -> dict:
    """Seconds to first step of each command (name -> argv of a `meshtrain`), alternated."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for i in range(runs):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(first_step_seconds(commands[name], extra))
            if progress:
                progress(f"{name}: {times[name][-1]:.2f} s")
    return times


def format_report(times: dict[str, list[float]]) -> str:
    return "\n".join(f"{name}: time to first step, median {statistics.median(ts):.2f} s over "
                     f"{len(ts)} runs ({', '.join(f'{t:.2f}' for t in ts)})"
                     for name, ts in times.items())
