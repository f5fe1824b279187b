"""How fast `meshtrain.testing.run_ranks` starts N gloo ranks and runs one all_reduce.

    python benchmarks/bench_harness.py

The first call starts the forkserver (torch and meshtrain preloaded); later calls fork from
it. STYLE.md's figures for comparison: spawn 3.3 / 7.2 / 14.8 s at world 2 / 4 / 8.
"""
import statistics
import time

import torch
import torch.distributed as dist

from meshtrain.testing import run_ranks


def one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    start = time.perf_counter()
    run_ranks(2, one_all_reduce)
    print(f"first call (starts the forkserver), world 2: {time.perf_counter() - start:.2f} s")
    for world in (2, 4, 8):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            assert run_ranks(world, one_all_reduce) == [float(world)] * world
            times.append(time.perf_counter() - start)
        print(f"world {world}: median {statistics.median(times):.3f} s (5 runs)")


if __name__ == "__main__":
    main()
