"""Offload (`Plan(offload="cpu" | "disk")`, with ZeRO): the optimizer's tensors live off the
compute device (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021).

- "cpu": the master shards and optimizer states live in host memory (pinned on CUDA); the
  reduced gradient shards go to the host for the optimizer step and the updated shards come
  back. On a CPU-only machine the host is the compute device: nothing moves, and a notice
  says so once.
- "disk": the optimizer states, the fp32 master shards (bf16) and ZeRO-3's parameter shards
  live in memory-mapped files. The step reads them in (the kernel pages them in on first
  touch) and writes them back in place; after each step their pages are dropped from the
  process (`madvise(MADV_DONTNEED)`), so between steps they hold no resident memory. The
  files are written in a fresh directory per rank and run (`<dir>/meshtrain-offload-*`,
  made by mkdtemp: a later run never reads an earlier one's files) and removed when the
  trainer is closed or the process exits.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

import torch

from meshtrain.core.plan import PlanError


class OffloadNotice(UserWarning):
    """Offload that changes nothing on this machine, said once."""


def host_device(offload: str, compute: torch.device) -> torch.device:
    """Where the optimizer's tensors live: the host for "cpu" (pinned when it is not the
    compute device) and for "disk" (a file is host memory: masters, states and the
    gradients the step reads all on the host, never split between host and a GPU), else
    the compute device itself."""
    if offload == "cpu" and compute.type == "cpu":
        warnings.warn("offload='cpu' keeps optimizer states in host memory, which on this "
                      "CPU-only machine is where they already are: nothing moves (use "
                      "offload='disk' to take them out of memory)", OffloadNotice, stacklevel=3)
    return torch.device("cpu") if offload in ("cpu", "disk") else compute


class DiskStore:
    """Tensors backed by memory-mapped files in a private directory, and their eviction."""

    def __init__(self, directory: str | os.PathLike | None, needed_bytes: int, rank: int) -> None:
        base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            base.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f"meshtrain-offload-rank{rank}-", dir=base))
        except OSError as exc:
            raise PlanError(f"offload='disk' cannot write to {base} ({exc.strerror}); give a "
                            "writable folder (Plan(offload_dir=...), --offload-dir)") from None
        free = shutil.disk_usage(self.dir).free
        if free < needed_bytes:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise PlanError(f"offload='disk' needs {needed_bytes / 2**20:,.1f} MiB in {base} "
                            f"but {free / 2**20:,.1f} MiB are free; free some space or give "
                            "another folder (Plan(offload_dir=...), --offload-dir)")
        self._maps: list[mmap.mmap] = []
        self._count = 0
        self._cleanup = weakref.finalize(self, _remove, self.dir, self._maps)

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A file-backed tensor holding a copy of `like`."""
        nbytes = max(1, like.numel() * like.element_size())
        path = self.dir / f"t{self._count}"
        self._count += 1
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            mapped = mmap.mmap(f.fileno(), nbytes)
        self._maps.append(mapped)
        out = torch.frombuffer(mapped, dtype=like.dtype, count=like.numel()).view(like.shape)
        out.copy_(like)
        return out

    def evict(self) -> None:
        """Drop every file-backed page from this process's memory (the data stays on disk),
        and hand the heap the step's temporaries came from back to the OS."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)
        _trim_heap()

    def close(self) -> None:
        self._cleanup()


def _trim_heap() -> None:
    """glibc keeps freed heap memory for reuse: the optimizer step's temporaries (a few
    state-sized tensors) would stay resident. malloc_trim returns it; elsewhere, nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _remove(directory: Path, maps: list[mmap.mmap]) -> None:
    for mapped in maps:
        try:
            mapped.close()
        except BufferError:   # a tensor still views it: the mapping goes with the process
            pass
    shutil.rmtree(directory, ignore_errors=True)


class Offloader:
    """What a ZeRO sync calls to keep its optimizer tensors off the device."""

    def __init__(self, offload: str, compute: torch.device, directory, needed_bytes: int,
                 rank: int) -> None:
        self.kind = offload
        self.host = host_device(offload, compute)
        self.store = DiskStore(directory, needed_bytes, rank) if offload == "disk" else None
        # pinned host memory where the compute device is a GPU: its copies can be async
        self.pinned = offload == "cpu" and compute.type == "cuda"
        self._placed: set[int] = set()   # tensors already file-backed (by storage address)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where it lives between steps (a file-backed copy for "disk", pinned
        host memory for "cpu" beside a GPU)."""
        if self.store is None:   # a GPU's tensor comes to the host first (pinning needs one)
            tensor = tensor.to(self.host)
            return tensor.pin_memory() if self.pinned and not tensor.is_pinned() else tensor
        out = self.store.tensor(tensor)
        self._placed.add(out.untyped_storage().data_ptr())
        return out

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Move optimizer states created by this step to disk, then drop every file-backed
        page from memory until the next step (for "cpu" beside a GPU: pin them)."""
        if self.store is None and not self.pinned:
            return
        for state in optimizer.state.values():
            for key, value in state.items():
                if (_per_element(value)
                        and value.untyped_storage().data_ptr() not in self._placed
                        and not (self.pinned and value.is_pinned())):
                    state[key] = self.place(value)
        if self.store is not None:
            self.store.evict()

    def pinned_buffers(self, optimizer: torch.optim.Optimizer,
                       placed: list[torch.Tensor]) -> list[torch.Tensor]:
        """What is pinned for "cpu" beside a GPU: the tensors the sync `placed` (and the
        gradient buffers beside them) and the optimizer's per-element states; else nothing."""
        if not self.pinned:
            return []
        return placed + [v for state in optimizer.state.values() for v in state.values()
                         if _per_element(v)]

    def offloaded_bytes(self, tensors) -> int:
        """Bytes of `tensors` that live on disk."""
        return sum(t.numel() * t.element_size() for t in tensors
                   if t.untyped_storage().data_ptr() in self._placed)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _per_element(value) -> bool:
    """An optimizer state offload moves: one element per parameter element (a 0-dim step
    counter stays where the optimizer made it)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
