"""Where a step's time goes, per `bench single` contender: torch.profiler over a few steps.

    python -m meshtrain.bench.profile_step --model gpt2-124m --batch 8 --precision bf16

For each contender (plain PyTorch and meshtrain, eager and compiled; bench/single.py builds
them): the step's wall time between synchronisations, the device's busy time (the sum of
its kernels' times) and its idle share, the kernels launched per step, and the operators
that take the most device time and the most host time. A step that is mostly idle device
time is launch-bound (the host's work per kernel is the limit); one that is busy is bound
by its kernels, which the table names.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from meshtrain.bench import single
from meshtrain.bench.device import fence, gpt_batch
from meshtrain.core.device import DEVICE_ENV
from meshtrain.models.gpt import gpt_config


def _device_time(event) -> float:
    """An operator's self time on the device in microseconds (torch renamed the field)."""
    for field in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, field, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_contender(step, sync, steps: int, top: int, out) -> None:
    walls = []
    for _ in range(steps):   # timed apart from the profiler, which slows the host
        sync()
        start = time.perf_counter()
        step()
        sync()
        walls.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA]   # the device's work
    operators = [e for e in averages if e.device_type != DeviceType.CUDA]
    busy = sum(_device_time(e) for e in kernels) / steps / 1e6
    wall = statistics.median(walls)
    print(f"  step {wall * 1e3:.1f} ms (median of {steps}); device busy {busy * 1e3:.1f} ms "
          f"({1 - busy / wall:.0%} idle); {sum(e.count for e in kernels) / steps:.0f} "
          f"kernels a step", file=out)
    tables = (("operators by the device time of the kernels they launch", operators,
               _device_time, top),
              ("kernels by device time", kernels, _device_time, top // 2),
              ("operators by host time", operators, lambda e: e.self_cpu_time_total, top // 2))
    for title, events, key, rows in tables:
        print(f"  {title} (self, per step):", file=out)
        for e in sorted(events, key=key, reverse=True)[:rows]:
            print(f"    {key(e) / steps / 1e3:8.2f} ms  x{e.count // steps:<5d} {e.key[:90]}",
                  file=out)
    out.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--contenders", nargs="+",
                        default=list(single.CONTENDERS) + [single.OURS_CUDA_GRAPHS])
    args = parser.parse_args(argv)
    os.environ[DEVICE_ENV] = args.device
    where = torch.device(args.device)
    config = gpt_config(args.model)
    x, y = gpt_batch(args.model, args.batch, where)
    build = {single.TORCH_EAGER: lambda: single._plain(config, where, args.precision, None, x, y),
             single.TORCH_COMPILED: lambda: single._plain(config, where, args.precision,
                                                          "inductor", x, y),
             single.OURS_EAGER: lambda: single._ours(config, args.precision, None, x, y),
             single.OURS_COMPILED: lambda: single._ours(config, args.precision, "inductor", x, y),
             single.OURS_CUDA_GRAPHS: lambda: single._ours(config, args.precision, "cudagraphs",
                                                           x, y)}
    sync = fence(where, barrier=False)
    for name in args.contenders:
        print(f"{name}: {args.model} GPT, batch {args.batch} x {config.seq_len}, "
              f"{args.precision} on {args.device}", flush=True)
        step = build[name]()
        for _ in range(args.warmup):
            step()
        profile_contender(step, sync, args.steps, args.top, sys.stdout)
        del step
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
