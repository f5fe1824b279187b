"""Collective algorithms side by side on this machine: time and bus bandwidth per size.

- all-reduce: c10d's, our ring (reduce-scatter + all-gather on send/recv) and our parameter
  server (reduce to a root, broadcast back), from reference_collectives.py;
- reduce-scatter: c10d's `reduce_scatter_single`, meshtrain's `Comm.reduce_scatter` (on gloo an
  all-to-all plus a local sum, see comm.py) and the ring's first half;
- all-gather: c10d's `all_gather_single`, meshtrain's `Comm.all_gather` (on gloo an all-to-all
  of the input repeated N times, see comm.py) and the ring's second half.
The variants of one operation alternate at each size; the median of the repetitions is quoted.
Bus bandwidth follows the usual convention (nccl-tests): all-reduce moves 2(N-1)/N x S per
rank, reduce-scatter and all-gather (N-1)/N x S, so equal bus bandwidths mean equally good use
of the links whatever the operation.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshtrain.core.comm import Comm, all_gather_single, reduce_scatter_single
from meshtrain.core.device import synchronize
from meshtrain.core.mesh import Mesh
from meshtrain.core.plan import Plan
from meshtrain.core.reference_collectives import (parameter_server_all_reduce, ring_all_gather,
                                                  ring_all_reduce, ring_reduce_scatter)

SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)   # bytes
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def _variants(comm: Comm, n: int, r: int, numel: int) -> dict[str, dict]:
    device = comm.mesh.device   # NCCL takes only device tensors
    full = torch.randn(numel, device=device)
    shard = torch.empty(numel // n, device=device)
    mine = full[r * (numel // n):(r + 1) * (numel // n)].clone()   # this rank's all-gather input
    ring_order = lambda chunks: [chunks[(i - 1) % n] for i in range(n)]   # rank r keeps chunk r
    return {
        "all_reduce": {
            "c10d": lambda: dist.all_reduce(full),
            "ring": lambda: ring_all_reduce(comm, full, "dp"),
            "parameter server": lambda: parameter_server_all_reduce(comm, full, "dp")},
        "reduce_scatter": {
            "c10d": lambda: reduce_scatter_single(shard, full),
            "meshtrain": lambda: comm.reduce_scatter(shard, full, "dp"),
            "ring": lambda: ring_reduce_scatter(comm, ring_order(list(full.tensor_split(n))), "dp")},
        "all_gather": {
            "c10d": lambda: all_gather_single(full, mine),
            "meshtrain": lambda: comm.all_gather(full, mine, "dp"),
            "ring": lambda: ring_all_gather(comm, ring_order(list(full.tensor_split(n))), "dp")},
    }


def collectives_rank(sizes: tuple[int, ...], reps: int,
                     ops: tuple[str, ...] = tuple(BUS_FACTOR)) -> dict:
    """On each rank: for every size and operation in `ops`, the variants' median seconds."""
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(Mesh.build(Plan(dp=n)))
    out: dict = {}
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        for op, variants in _variants(comm, n, r, numel).items():
            if op not in ops:
                continue
            for f in variants.values():
                f()   # warm-up
            times = {name: [] for name in variants}
            for rep in range(reps):
                names = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for name in names:
                    synchronize(comm.mesh.device)
                    dist.barrier()
                    t0 = time.perf_counter()
                    variants[name]()
                    synchronize(comm.mesh.device)   # CUDA queues it: the time is the device's
                    times[name].append(time.perf_counter() - t0)
            out.setdefault(op, {})[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    return out


def run(worlds=(2, 4), sizes=SIZES, reps: int = 7, progress=print,
        ops: tuple[str, ...] = tuple(BUS_FACTOR)) -> dict:
    from meshtrain.launch import launch

    result = {"sizes": list(sizes), "reps": reps, "worlds": {}}
    for world in worlds:
        progress(f"world {world}: all-reduce, reduce-scatter, all-gather variants ...")
        ranks = launch(collectives_rank, world, (tuple(sizes), reps, tuple(ops)))
        # a collective ends when its slowest rank does
        merged = {op: {size: {name: max(rk[op][size][name] for rk in ranks)
                              for name in ranks[0][op][size]}
                       for size in sizes} for op in ranks[0]}
        result["worlds"][world] = merged
    return result


def format_report(result: dict) -> str:
    lines = [f"median of {result['reps']} alternating repetitions; busbw = bytes x bus factor / "
             "time (all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N)"]
    for world, ops in result["worlds"].items():
        for op, by_size in ops.items():
            names = list(next(iter(by_size.values())))
            lines.append(f"world {world} {op}: " + " | ".join(f"{name} ms (GB/s)" for name in names))
            for size, t in by_size.items():
                cells = [f"{t[name] * 1e3:8.2f} ({size * BUS_FACTOR[op](world) / t[name] / 1e9:5.2f})"
                         for name in names]
                lines.append(f"  {_size(size):>7} " + " | ".join(cells))
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"
