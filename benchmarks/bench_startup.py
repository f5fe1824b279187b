"""Time to first step of `meshtrain train`: from the command's start until the first step's
record reaches metrics.jsonl, measured from outside (any version of meshtrain), median of N.
With --against, two installations alternate run by run (a noisy machine hits both alike).

    python benchmarks/bench_startup.py [--runs 5] [--against OTHER/bin/meshtrain] [-- args]
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def first_step_seconds(meshtrain: str, extra: list[str]) -> float:
    run = Path(tempfile.mkdtemp(prefix="meshtrain-startup-")) / "run"
    metrics = run / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen([meshtrain, "train", "--steps", "2", "--run-dir", str(run),
                             "--no-progress", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            if metrics.exists() and any("loss" in json.loads(line) for line in
                                        metrics.read_text().splitlines() if line.strip()):
                return time.perf_counter() - start
            time.sleep(0.01)
        raise RuntimeError(f"meshtrain train exited ({proc.returncode}) before a first step")
    finally:
        proc.wait()
        shutil.rmtree(run.parent, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--meshtrain", default=str(Path(sys.executable).parent / "meshtrain"))
    parser.add_argument("--against", help="another installation's meshtrain, run alternately")
    parser.add_argument("extra", nargs="*", help="more `meshtrain train` arguments")
    args = parser.parse_args()
    commands = [args.meshtrain] + ([args.against] if args.against else [])
    times: dict[str, list[float]] = {c: [] for c in commands}
    for i in range(args.runs):
        for command in (commands if i % 2 == 0 else commands[::-1]):
            times[command].append(first_step_seconds(command, args.extra))
    for command, ts in times.items():
        print(f"{command}: time to first step, median {statistics.median(ts):.2f} s over "
              f"{len(ts)} runs ({', '.join(f'{t:.2f}' for t in ts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
