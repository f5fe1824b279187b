"""Exact memory accounting: bytes held by this rank, counted from tensor storages.

Parameters, gradients and optimizer states are summed over *unique* storages (a gradient
that is a view into a flat bucket counts the bucket once). Activations are the bytes autograd
saved for backward during one forward, measured with saved-tensor hooks, parameters excluded.
Beside them, the process's peak resident memory as the OS reports it, and on CUDA the
device's own allocated and peak bytes (core/device.py).
"""
from __future__ import annotations

import resource
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def peak_process_bytes() -> int:
    """Peak resident set size of this process since it started or since the last
    `reset_process_peak()` (Linux's VmHWM; elsewhere the lifetime peak, ru_maxrss)."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux), else None."""
    return _status_bytes("VmRSS")


# The kernel keeps one peak per process (VmHWM), and a reset loses it. So every reset goes
# through `reset_process_peak`, which first records the peak it ends: a window that spans
# resets (`peak_mark` / `peak_since`: plan --verify's, from before the build to the last
# step) still sees the highest. Process-wide by nature, as the counter it extends.
_ENDED_PEAKS: list[int] = []


def reset_process_peak() -> bool:
    """Start a new peak window: the peak resident size becomes the current one (Linux's
    clear_refs 5), so a phase's peak (building, training) is told apart from the one
    before it; the ended peak is kept for windows spanning this reset. False where the
    system cannot (the peak then stays the lifetime's)."""
    ended = _status_bytes("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    if ended is not None:
        _ENDED_PEAKS.append(ended)
    return True


def peak_mark() -> int:
    """Where a window starts, for `peak_since` (after its own reset)."""
    return len(_ENDED_PEAKS)


def peak_since(mark: int) -> int:
    """The peak resident size since `peak_mark()` gave `mark`, across any resets since."""
    return max([peak_process_bytes(), *_ENDED_PEAKS[mark:]])


def process_status(fields: tuple[str, ...]) -> dict[str, int]:
    """Those of /proc/self/status's memory fields (kB there) in bytes; empty off Linux."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def _status_bytes(field: str) -> int | None:
    return process_status((field,)).get(field)


@dataclass
class MemoryReport:
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int | None  # None until a step has been measured
    peak_process: int
    offloaded: int = 0               # optimizer tensors held on disk, not in memory
    gathered_peak: int | None = None  # ZeRO-3: most bytes of gathered units at once
    gradients_in_flight: int | None = None  # ZeRO-2/3: most bytes of whole gradient buckets
                                            # alive at once in backward, beside the shards
    staging: int = 0                 # most bytes of gloo's staging buffers alive at once
                                     # (core/comm.py: a gather's or scatter's whole copy)
    device_allocated: int | None = None  # CUDA: the allocator's bytes now (None on CPU)
    device_peak: int | None = None       # CUDA: its peak allocated bytes (None on CPU)
    host_pinned: int = 0             # CUDA: pinned host bytes offload holds (pinned_buffers)
    optimizer_on_host: int = 0       # CUDA: of optimizer_states, the bytes in host memory
    build_peak: int | None = None    # the process's peak while the Trainer built (and loaded)
    runtime: int | None = None       # resident before the model had memory: the runtime's
                                     # fixed cost (interpreter, torch, libraries, groups)
    checkpoint_peak: int | None = None   # the process's peak while saving a checkpoint
    checkpoint_share: int = 0        # its share of the consolidated state a save holds

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def accounted(self) -> int:
        """Every byte counted from tensors: model states, gathered units, gradient buckets
        in flight, collectives' staging buffers, activations (each at its own peak)."""
        return (self.model_states + (self.gathered_peak or 0) + (self.activations or 0)
                + (self.gradients_in_flight or 0) + self.staging)

    @property
    def unaccounted(self) -> int | None:
        """What the training peak holds beyond the runtime and the accounted bytes (CPU)."""
        if self.runtime is None or self.device_peak is not None:
            return None
        return self.peak_process - self.runtime - self.accounted

    def to_dict(self) -> dict:
        return dict(asdict(self), model_states=self.model_states, accounted=self.accounted,
                    unaccounted=self.unaccounted)


class ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded) inside `measure()`.

    A parameter is recognised by its storage as it is when the tensor is saved (ZeRO-3
    gathers parameters into fresh buffers during forward), so the views of a parameter that
    some ops save (a transposed weight) are not counted either. Reading every parameter's
    storage again for each saved tensor cost a 12-block GPT more host time than its step, so
    a saved tensor is first matched by identity (the parameter, or a view of it:
    what a gathered ZeRO-3 unit saves), then against the storages the parameters held when
    the measurement began, re-read only where one matches (it may have been freed since)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = list(params)
        self._seen: dict[int, int] | None = None   # storages seen in the current measure()
        self._ids: set[int] = set()                # the parameters' ids, while measuring
        self._storages: set[int] = set()           # ... their storages when it began
        self.last_bytes: int | None = None

    def track(self, params: Iterable[torch.Tensor]) -> None:
        """Recognise `params` from now on, in place of the earlier ones (a pipeline stage
        keeps only its own: the others must not be held alive here)."""
        self._params = list(params)

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors held for backward outside autograd's saved tensors (the inputs
        recomputation keeps), while a measurement runs."""
        if self._seen is None:
            return
        for t in tensors:
            if id(t) in self._ids or (t._base is not None and id(t._base) in self._ids):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._storages and ptr in self._param_storages():
                continue
            self._seen[ptr] = storage.nbytes()

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self._params}

    @contextmanager
    def measure(self):
        self._seen = seen = {}
        self._ids = {id(p) for p in self._params}
        self._storages = self._param_storages() - {0}   # a released ZeRO-3 unit holds none

        def pack(t: torch.Tensor):
            self.keep([t])
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            self._seen, self._ids, self._storages = None, set(), set()
        self.last_bytes = sum(seen.values())
