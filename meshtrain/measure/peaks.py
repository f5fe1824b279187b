"""A rank's memory peaks over a window, as `plan --verify` and `plan --calibrate` measure them.

- `allocated_peak`: the most bytes of live tensors while a function runs (the allocator's
  own count: torch.profiler's memory events on CPU, the caching allocator's peak on CUDA);
- `peak_meter(device)`: the growth of the memory the rank needs from its device over a
  window opened by `start()` and closed by `stop()`: on CPU the process's anonymous
  resident memory (`ResidentPeak`), what the OS must provide; on CUDA the memory the
  caching allocator reserves on the GPU (`DevicePeak`), what the GPU must provide. Each is
  compared with the planner's total memory per rank, which on CUDA is the GPU's.
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

import torch

from meshtrain.core.device import device_memory, reset_peak, synchronize
from meshtrain.core.memory import peak_mark, peak_since, process_status, reset_process_peak


def allocated_peak(fn, device: torch.device) -> int:
    """Highest bytes of tensors allocated and not yet freed while `fn()` runs, above what was
    live before it: on CPU the running sum of the allocator's [memory] events (torch.profiler
    with profile_memory), which see every tensor and kernel workspace the allocator serves;
    on CUDA the caching allocator's own peak."""
    if device.type == "cuda":
        synchronize(device)
        reset_peak(device)
        before = device_memory(device)["device_allocated"]
        fn()
        synchronize(device)
        return device_memory(device)["device_peak"] - before
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_banner(), profile(activities=[ProfilerActivity.CPU],
                                             profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextmanager
def _without_profiler_banner():
    """The profiler (kineto) writes "USDT: ... profiler_start/stop" lines on the process's C
    stderr each time it runs; drop those, pass anything else through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "STAGE:")):
                    sys.stderr.write(line)


def peak_meter(device: torch.device) -> ResidentPeak | DevicePeak:
    """The meter of a rank's memory peak on `device`: the GPU's memory on CUDA, the
    process's resident memory on CPU (where the host's memory is the rank's)."""
    return DevicePeak(device) if device.type == "cuda" else ResidentPeak()


class ResidentPeak:
    """Peak growth of this process's anonymous resident memory (heap: tensors and the
    allocator's arenas) over a window, from the kernel's own high-water mark, which sees
    every page however briefly it was resident (a poller sampling /proc misses short peaks,
    and on oversubscribed cores its thread slows the step it watches).

    Linux: writing 5 to /proc/self/clear_refs resets VmHWM (the peak resident set) to the
    current resident set. At the end, the peak resident set less the file-backed and shared
    pages resident then (library code the first steps touched, which stays) is the peak of
    the anonymous part. The Trainer resets the peak too (its building and training peaks,
    core/memory.py); the window keeps the highest across those resets."""
    def start(self) -> None:
        if not reset_process_peak():
            raise OSError("cannot reset this process's peak resident memory through "
                          "/proc/self/clear_refs: --verify measures peak memory on Linux only")
        self.mark = peak_mark()   # the Trainer's own resets (build, training) stay inside
        self.base = self._status()["RssAnon"]

    def stop(self) -> int:
        s = self._status()
        return max(0, peak_since(self.mark) - s["RssFile"] - s.get("RssShmem", 0) - self.base)

    @staticmethod
    def _status() -> dict[str, int]:
        return process_status(("VmHWM", "RssAnon", "RssFile", "RssShmem"))


class DevicePeak:
    """Peak growth of the GPU memory the CUDA caching allocator reserves over a window: its
    peak reserved bytes (the peak statistics reset at the start) above those reserved at
    the start.

    Reserved, not allocated: the allocator keeps freed blocks cached and rounds requests up
    to its block sizes, so the GPU must hold what it reserved, and a step runs out of memory
    when a request finds no cached block and no room for a new one, whatever the allocated
    bytes; the allocated peak is `allocated_peak`'s, the report's other column, and the
    reserved bytes beyond it are the runtime memory calibration fits (as the host heap's
    beyond the tensors on CPU). Neither sees the CUDA context or NCCL's own buffers."""
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        synchronize(self.device)   # initialises CUDA too: the reset needs its allocator
        reset_peak(self.device)
        self.base = torch.cuda.memory_reserved(self.device)

    def stop(self) -> int:
        synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device) - self.base
