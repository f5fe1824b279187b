"""Where ranks run, and what the device itself measures.

One place resolves the device choice (`auto | cpu | cuda`; when none is given,
MESHTRAIN_DEVICE, else auto) and checks it against the machine before any rank starts
(`resolve_device`, `check_ranks_fit`). The choice reaches the ranks as MESHTRAIN_DEVICE in
each rank's environment (set by `launch.init_distributed` or
`testing.run_ranks`), and each rank's own device comes from LOCAL_RANK (`rank_device`), never
from whatever device happened to be current.

The processes meshtrain starts (its command, `launch`'s ranks) use the caching allocator's
expandable segments on CUDA unless PYTORCH_CUDA_ALLOC_CONF says otherwise
(`prefer_expandable_segments`).

On CUDA the default process group is "cpu:gloo,cuda:nccl": NCCL for device tensors, gloo for
the host tensors (offloaded state, host scalars) that NCCL never accepts. Batches are made in
pinned host memory there and copied without blocking (`pin_host_batches`, `to_device`).

The device's own figures: on CUDA, the GPU's memory (`total_memory`), memory from the
caching allocator (allocated now, peak allocated) and pinned host bytes, and a clock read
only after the device has finished its queued work (`DeviceClock`), or marks on the
device's timeline (`Stopwatch`: CUDA events) for a timeline of many short pieces of work.
On CPU these are the host's own: no device memory, the plain clock.
"""
from __future__ import annotations

import os
import time
from typing import Iterable

import torch

DEVICE_ENV = "MESHTRAIN_DEVICE"
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
CHOICES = ("auto", "cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
CPU_RANKS = 2   # the default rank count on CPU (DDP over two ranks)


class DeviceError(ValueError):
    """The device choice does not fit this machine; the message names the way out."""


def resolve_device(choice: str | None = None) -> str:
    """"cpu" or "cuda" for a choice of auto (CUDA when a GPU is visible), cpu or cuda; no
    choice reads MESHTRAIN_DEVICE, else auto."""
    choice = choice or os.environ.get(DEVICE_ENV) or "auto"
    if choice not in CHOICES:
        raise DeviceError(f"--device {choice!r}: choose one of {', '.join(CHOICES)}")
    visible = torch.cuda.is_available()
    if choice == "auto":
        return "cuda" if visible else "cpu"
    if choice == "cuda" and not visible:
        raise DeviceError("--device cuda: no CUDA GPU is visible to this process "
                          "(torch.cuda.is_available() is False: a CPU build of torch, no "
                          "driver, or CUDA_VISIBLE_DEVICES empty); use --device cpu (or auto)")
    return choice


def prefer_expandable_segments() -> None:
    """CUDA's caching allocator with expandable segments (torchtitan's setting too), unless
    the user's PYTORCH_CUDA_ALLOC_CONF says otherwise: each pool grows one segment page by
    page instead of keeping blocks of fixed-size segments that later requests of other sizes
    cannot reuse, so what it reserves stays near what is allocated (less memory lost to
    fragmentation, and the planner's device peak, calibrated under it, holds). Read when
    the allocator starts: before this process's first CUDA allocation, and inherited by
    the ranks it starts."""
    os.environ.setdefault(ALLOCATOR_ENV, "expandable_segments:True")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_ranks(device: str) -> int:
    """Ranks to start when none is asked for: one per visible GPU, or two on CPU."""
    return gpu_count() if device == "cuda" else CPU_RANKS


def check_ranks_fit(device: str, nproc: int) -> None:
    """Refuse more local ranks than GPUs on CUDA (one rank per GPU), before any starts."""
    if device != "cuda":
        return
    gpus = gpu_count()
    if nproc > gpus:
        raise DeviceError(f"{nproc} ranks on CUDA, but this machine has {gpus} visible GPU(s) "
                          f"and each rank needs its own: use --nproc {gpus} (with a plan of at "
                          f"most {gpus} ranks), or --device cpu to run {nproc} ranks on the CPU")


def rank_device(device: str | None = None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK on CUDA, else the CPU.

    `device` defaults to MESHTRAIN_DEVICE from the environment, then to auto."""
    kind = resolve_device(device)
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= gpu_count():
        raise DeviceError(f"LOCAL_RANK {local} on CUDA, but this machine has {gpu_count()} "
                          f"visible GPU(s): start at most {gpu_count()} ranks per node "
                          "(--nproc / --nproc-per-node), or use --device cpu")
    return torch.device("cuda", local)


def backend_for(device: torch.device) -> str:
    """The default group's backend: gloo on CPU; on CUDA, NCCL beside gloo for host tensors."""
    return CUDA_BACKEND if device.type == "cuda" else "gloo"


# ---- batches onto the device -------------------------------------------------------------------
def pin_host_batches(device: torch.device) -> bool:
    """Whether batches bound for `device` are made in pinned host memory: on CUDA a copy
    from pinned memory is queued without blocking the host (from pageable memory the host
    waits while the driver stages it); on CPU there is no copy to make."""
    return device.type == "cuda"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: from pinned host memory to a GPU without blocking (queued on the
    current stream, ahead of the kernels that read it); otherwise as `.to` (on the CPU, the
    tensor itself)."""
    async_copy = device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.to(device, non_blocking=async_copy)


def device_name(device: torch.device) -> str | None:
    """The GPU's product name ("NVIDIA H100 80GB HBM3"); None on CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def device_capability(device: torch.device) -> tuple[tuple[int, int] | None, str]:
    """A CUDA device's compute capability and name ((None, "") for a CPU)."""
    if device.type != "cuda":
        return None, ""
    return torch.cuda.get_device_capability(device), device_name(device)


def total_memory(device: torch.device) -> int | None:
    """The GPU's memory in bytes, all of it (the CUDA context's share included); None on CPU,
    whose ranks share the host's."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


# ---- what the device measures ------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceClock:
    """Seconds of device work: the clock is read only once the device has finished what was
    queued (CUDA runs asynchronously; the host clock alone would time the launches)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()


class Stopwatch:
    """Marks on the device's own timeline, read as seconds since `start` once the work is done.

    On CPU a mark is the host clock. On CUDA it is an event recorded on the current stream
    (the host clock would time the launches, not the work), so marking costs no
    synchronisation: `start` synchronises once, so that `origin` (the host clock at the
    start, which local ranks share) lines their timelines up, and `seconds` waits for a
    mark's event before reading it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.origin = 0.0
        self._start = None

    def start(self) -> None:
        if self.cuda:
            synchronize(self.device)
            self._start = self._event()
        self.origin = time.perf_counter()

    def mark(self):
        """Now, on the device's timeline: seconds since the start (CPU) or an event (CUDA)."""
        return self._event() if self.cuda else time.perf_counter() - self.origin

    def seconds(self, mark) -> float:
        """A mark as seconds since the start (waits for its event on CUDA)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self._start.elapsed_time(mark) / 1e3   # elapsed_time is in milliseconds

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def device_memory(device: torch.device) -> dict | None:
    """On CUDA, the caching allocator's bytes: allocated now and the peak allocated (since
    the start or the last `reset_peak`); None on CPU, where the host figures are the memory."""
    if device.type != "cuda":
        return None
    return {"device_allocated": int(torch.cuda.memory_allocated(device)),
            "device_peak": int(torch.cuda.max_memory_allocated(device))}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def pinned_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct pinned (page-locked) host storages among `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_pinned():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
