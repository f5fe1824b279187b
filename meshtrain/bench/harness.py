"""How fast `meshtrain.testing.run_ranks` starts N gloo ranks and runs one all_reduce
(`meshtrain bench harness`): the cost every multi-rank test pays.

The first call starts the forkserver (torch and meshtrain preloaded); later calls fork from
it. For comparison, starting ranks with `spawn` (each rank imports torch) takes seconds per
rank (docs/history.md).
"""
from __future__ import annotations

import statistics
import time


def one_all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def run(worlds: list[int], reps: int, progress=None) -> dict:
    """Seconds of the first call (world 2, starting the forkserver) and of each later call."""
    from meshtrain.testing import run_ranks

    start = time.perf_counter()
    run_ranks(2, one_all_reduce)
    result = {"first_call_s": time.perf_counter() - start, "worlds": {}}
    for world in worlds:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            if run_ranks(world, one_all_reduce) != [float(world)] * world:
                raise RuntimeError(f"all_reduce of ones over {world} ranks gave a wrong sum")
            times.append(time.perf_counter() - start)
        result["worlds"][world] = times
        if progress:
            progress(f"world {world}: median {statistics.median(times):.3f} s")
    return result


def format_report(result: dict) -> str:
    lines = [f"first call (starts the forkserver), world 2: {result['first_call_s']:.2f} s"]
    for world, times in result["worlds"].items():
        lines.append(f"world {world}: median {statistics.median(times):.3f} s "
                     f"({len(times)} runs)")
    return "\n".join(lines)
