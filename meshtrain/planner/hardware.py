"""Devices and links: presets for common GPUs and interconnects, and the Cluster they form.

Bandwidth convention (used by every time formula): `intra_bw` and `inter_bw` are the rate one
GPU achieves on its own link in a ring collective, i.e. the `B` in the ring cost
`2(N-1)/N * S / B`. `inter_bw` is per GPU: a node with 8 GPUs and 8 x 200 Gb/s HDR
InfiniBand rails has inter_bw = 25 GB/s. Presets quote the vendor's per-GPU figure; a
calibrated profile (`--cluster local`) replaces them with measured bus bandwidths per
collective and message size.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from meshtrain.core.gpus import GPUS, device_kind  # noqa: F401  (presets; profiles name kinds)
from meshtrain.core.gpus import peak_flops as table_peak
from meshtrain.core.units import parse_bandwidth, parse_bytes, parse_flops


class HardwareError(ValueError):
    """Unknown preset or an impossible cluster: the message names it and the fix."""


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of buffer in a ring collective over `n` ranks (Thakur
    et al. 2005): all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast and
    point-to-point 1. Calibration turns measured times into bus bandwidth with it, and the
    time model divides by that bandwidth with it again. An all-to-all sends (n-1)/n of its
    buffer, each rank to every other directly (in n-1 steps, as the ring collectives)."""
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "broadcast": 1.0, "p2p": 1.0,
            "all_to_all": (n - 1) / n}[kind]


# Per-GPU bandwidths: NVLink 2/3/4 total per GPU 300/600/900 GB/s (NVIDIA datasheets);
# PCIe 4.0 x16 32 GB/s, 5.0 x16 64 GB/s; InfiniBand HDR 200 Gb/s, NDR 400 Gb/s per rail;
# Ethernet by line rate.
LINKS = {
    "nvlink2": 300e9, "nvlink3": 600e9, "nvlink4": 900e9,
    "pcie4": 32e9, "pcie5": 64e9,
    "ib-hdr": 25e9, "ib-ndr": 50e9,
    "eth-100g": 12.5e9, "eth-25g": 3.125e9, "eth-10g": 1.25e9,
}
# Latency per collective hop (alpha in the alpha-beta model, Thakur et al. 2005).
INTRA_LATENCY = 5e-6
INTER_LATENCY = 20e-6


def lookup(table: dict, name: str, what: str, flag: str):
    """`table`'s entry for `name`: its key in any case, or the one key it begins ('h100')."""
    wanted = str(name).lower()
    for key, value in table.items():
        if key.lower() == wanted:
            return value
    begun = [key for key in table if key.lower().startswith(wanted)]
    if len(begun) == 1:
        return table[begun[0]]
    if begun:
        raise HardwareError(f"{what} {name!r} could be {' or '.join(begun)}: name one")
    raise HardwareError(f"unknown {what} {name!r}; choose one of {', '.join(table)} "
                        f"or give the number itself with {flag}")


def bandwidth(text: str) -> float:
    """A link preset name ('nvlink3', 'ib-hdr') or a rate with units ('25GB/s')."""
    for key, value in LINKS.items():
        if key.lower() == str(text).lower():
            return value
    return parse_bandwidth(text)


# A fully recomputed block runs its forward twice: a third of a block's work (forward and
# backward) more, and, where not calibrated, a third more of its dispatch
RECOMPUTED_BLOCK = 4 / 3


@dataclass(frozen=True)
class Curve:
    """Measured bus bandwidth of one collective against message size (log-linear between)."""
    sizes: tuple[float, ...]        # bytes, ascending
    busbw: tuple[float, ...]        # bytes/s at each size
    latency: float = 0.0            # seconds: the fixed cost of one call

    def at(self, nbytes: float) -> float:
        if nbytes <= self.sizes[0]:
            return self.busbw[0]
        if nbytes >= self.sizes[-1]:
            return self.busbw[-1]
        i = bisect.bisect_right(self.sizes, nbytes)
        x0, x1 = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        w = (math.log(nbytes) - x0) / (x1 - x0)
        return self.busbw[i - 1] * (1 - w) + self.busbw[i] * w


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem: float = 80e9           # bytes per device
    intra_bw: float = 600e9         # bytes/s per GPU inside a node
    inter_bw: float = 25e9          # bytes/s per GPU across nodes
    inter_latency: float = INTER_LATENCY   # seconds per message step across nodes
    peak_flops: float = 312e12      # dense FLOP/s per device at the training precision
                                    # (bf16 under fp8: MFU's basis, as torchtitan's)
    fp8_flops: float = 0.0          # dense float8 FLOP/s, at which an fp8 plan's block
                                    # linears run (0: the card has none)
    efficiency: float = 0.5         # achievable / peak for transformer matmuls
    mem_bw: float = 2.0e12          # device memory bytes/s (the optimizer step is bound by it)
    host_bw: float = 32e9           # device <-> host (offload) bytes/s per GPU
    host_mem: float = 1e12          # host bytes per node available for offload
    host_update_rate: float = 1e9   # parameters/s a node's CPUs update with Adam (offload)
    reserve: float = 0.1            # fraction of device memory kept for context/fragmentation
    # Calibrated on a local profile (`meshtrain plan --calibrate`); presets keep the defaults:
    runtime_fixed: float = 0.0      # bytes of a rank's working memory outside tensors
    runtime_per_act: float = 0.0    # ... and more per byte a micro-batch's forward allocates
    runtime_first_layer: float | None = None   # ... per byte of its first layer's (the heap
                                    # keeps most of one layer's temporaries); None: per_act
    runtime_line: tuple | None = None   # (fixed, per byte of all forward traffic): the heap
                                    # of tensor-parallel ranks (memory_terms)
    accumulation_memory: float = 0.0   # runtime bytes several micro-batches a step add
                                    # outside a pipeline (a pipeline's are in pp_memory)
    optimizer_rate: float = 0.0     # parameters/s the optimizer step updates (0: from mem_bw)
    overlap: float = 1.0            # fraction of hideable gradient traffic really hidden
    block_overhead: float = 0.0     # seconds per block per micro-batch not in FLOPs (dispatch)
    recompute_dispatch: float = RECOMPUTED_BLOCK   # ... blocks' dispatch a fully
                                    # recomputed block costs (a GPU's host: calibrated)
    layer_step_overhead: float = 0.0   # host seconds per step per layer a rank holds (the
                                    # optimizer's per-tensor work; a GPU's host: calibrated)
    compute_scale: float = 1.0      # the Trainer's micro-batch against the bare model's
    step_overhead: float = 0.0      # seconds per step the Trainer adds (calibrated)
    process_trainer: tuple | None = None   # (compute_scale, step_overhead) of one process
                                    # (DP's replica threads: no DDP hooks, no backend threads)
    idle_speedup: float = 1.0       # how much faster a rank computes while others idle
    host_is_device: bool = False    # CPU ranks: "host" memory is the ranks' own memory
    optimizer_temporaries: float | None = None   # bytes per parameter the optimizer step
                                    # allocates beside the states (GPU ranks of a local
                                    # profile; None: not measured, and the step's moment
                                    # counts mixed precision's fp32 gradients only)
    async_dispatch: bool = False    # GPU ranks of a local profile: the host dispatches a
                                    # micro-batch while the device runs it (max, not sum)
    elementwise_apart: bool = False  # `efficiency` is the GEMMs' and attention's alone (a
                                    # GPU profile's): the elementwise work priced at mem_bw
    elementwise_bw: float = 0.0     # ... or at this speed (bytes/s) where calibrated apart
                                    # (CPU ranks: profile.elementwise_split); 0: mem_bw
    efficiency_curves: dict | None = field(default=None, compare=False)   # the measured GEMM
                                    # and attention efficiency by size ({"gemm", "attention",
                                    # "dtype"}: a profile's curves), priced per micro-batch
    tp_overhead: dict = field(default_factory=dict, compare=False)  # tp width -> seconds per
                                    # block per token beyond its FLOPs and collectives (the
                                    # work it cannot split; calibrated)
    tp_overhead_hidden: int = 0     # ... on a model this wide (0: any model's)
    staging: dict = field(default_factory=dict, compare=False)  # ZeRO stage (or "disk") ->
                                    # runtime bytes per byte of its largest collective buffer
    tp_memory: dict = field(default_factory=dict, compare=False)  # tp width -> runtime bytes
    sp_memory: dict = field(default_factory=dict, compare=False)  # tp width -> (runtime
                                    # bytes, and per byte of forward traffic) sequence
                                    # parallel adds
    pp_overhead: float = 0.0        # seconds per micro-batch per stage chunk (pipeline runtime)
    pp_memory: float | tuple = 0.0  # runtime bytes a pipeline stage's buffers add: one for
                                    # all, or (a stage before the last, the last stage)
    pp_tp_memory: tuple | None = None   # ... the same with tensor parallel in every stage
    pp_tp_scale: float = 1.0        # tensor parallel's collectives in a pipeline against the
                                    # curve's price (calibrated: one stage's collectives wait
                                    # on the other's compute, or hide behind it)
    disk_overhead: float = 0.0      # seconds per byte offloaded to disk, per step
    name: str = "custom"
    curves: dict = field(default_factory=dict, compare=False)  # collective -> Curve (calibrated)
    curves_intra_only: bool = False  # the curves were measured inside one node (a calibrated
                                    # GPU): groups spanning nodes use inter_bw; False: all groups
    calibration: dict | None = field(default=None, compare=False)  # which figures a profile
                                    # gave, and its date (planner.calibrated); None: none

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HardwareError(f"--{key.replace('_', '-')} {v!r}: must be a whole number >= 1")
        for key in ("gpu_mem", "intra_bw", "inter_bw", "peak_flops", "mem_bw", "host_bw",
                    "host_update_rate"):
            if not getattr(self, key) > 0:
                raise HardwareError(f"{key}={getattr(self, key)!r}: must be positive")
        if not 0 < self.efficiency <= 1:
            raise HardwareError(f"efficiency={self.efficiency!r}: must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise HardwareError(f"overlap={self.overlap!r}: must be in [0, 1]")
        if self.block_overhead < 0 or self.idle_speedup < 1:
            raise HardwareError(f"block_overhead={self.block_overhead!r} must be >= 0 and "
                                f"idle_speedup={self.idle_speedup!r} >= 1")
        if not 0 <= self.reserve < 1:
            raise HardwareError(f"reserve={self.reserve!r}: must be in [0, 1)")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_mem(self) -> float:
        return self.gpu_mem * (1 - self.reserve)

    @property
    def curves_replace_links(self) -> bool:
        """Measured curves price every group, the inter-node link's included."""
        return bool(self.curves) and not self.curves_intra_only

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group spanning `span` consecutive ranks: intra-node when
        the ranks it touches lie in one node, else bounded by the inter-node link."""
        if span <= self.gpus_per_node:
            return self.intra_bw, INTRA_LATENCY
        return self.inter_bw, self.inter_latency

    def collective_time(self, kind: str, nbytes: float, n: int, span: int) -> float:
        """Seconds for one collective of an `nbytes` buffer over `n` ranks spanning `span`.

        Ring costs per rank (Thakur et al. 2005; Patarasuk & Yuan 2009): all-reduce
        2(n-1)/n * S, reduce-scatter and all-gather (n-1)/n * S, broadcast S. With a
        calibrated curve the measured bus bandwidth at that size replaces the link figure.
        """
        if n <= 1 or nbytes <= 0:
            return 0.0
        factor = ring_factor(kind, n)
        curve = self.curves.get(kind)
        if curve is not None and (span <= self.gpus_per_node or not self.curves_intra_only):
            return curve.latency + factor * nbytes / curve.at(nbytes)
        bw, alpha = self.link(span)
        steps = {"all_reduce": 2 * (n - 1), "broadcast": 1, "p2p": 1}.get(kind, n - 1)
        return steps * alpha + factor * nbytes / bw

    @property
    def runtime(self) -> tuple[float, float, float, float]:
        """(fixed bytes, per byte of a micro-batch's forward traffic, per byte of its first
        layer's, bytes accumulating over micro-batches adds): `memory.memory`'s runtime."""
        first = self.runtime_per_act if self.runtime_first_layer is None else self.runtime_first_layer
        return self.runtime_fixed, self.runtime_per_act, first, self.accumulation_memory

    def memory_terms(self, plan) -> dict:
        """The calibrated runtime-memory terms `memory.memory` takes for `plan` (all 0 on
        presets): the fixed and per-activation runtime, ZeRO's staging factor, and what
        tensor and pipeline parallel's buffers add."""
        # tensor and pipeline parallel's buffers live at different moments of a step, and
        # the heap one frees serves the other: the larger of the two, unless a pipeline
        # with tensor parallel was calibrated as such; a pipeline's, per stage kind
        tp = nearest(self.tp_memory, plan.tp) if plan.tp > 1 else 0.0
        # sequence parallel, calibrated as such: fixed, and per byte of forward traffic
        # (its gathers' staging grows with the layers), in place of tp's term
        sp_heap = 0.0
        if plan.tp > 1 and plan.sequence_parallel and self.sp_memory:
            tp, sp_heap = nearest(self.sp_memory, plan.tp)
        extra = tp
        if plan.pp > 1:
            per_stage = (self.pp_tp_memory if plan.tp > 1 and self.pp_tp_memory else
                         tuple(max(tp, x) for x in _stage_pair(self.pp_memory)))
            if plan.schedule in ("gpipe", "naive") or plan.virtual_stages > 1:
                # the last rank, too, keeps every micro-batch's messages (GPipe), or sends
                # activations out of its earlier chunks (interleaved): the first's term
                per_stage = (per_stage[0],) * 2
            extra = tuple(per_stage)
        zero = plan.zero
        if zero == 3 and plan.recompute == "full" and "3+recompute" in self.staging:
            zero = "3+recompute"   # the recomputed forward gathers every unit again
        # tensor parallel's collectives run inside every layer, and the buffers they keep
        # sit between the layers' freed temporaries: the heap cannot pass one layer's to
        # the next and grows with all the forward traffic (measured: the first-layer
        # terms under-predicted tp = 2 and 4 by 6-9%, one rate for all within 4%)
        runtime = self.runtime
        if plan.tp > 1 and self.runtime_line:
            runtime = (self.runtime_line[0], *self.runtime_line[1:2] * 2, self.accumulation_memory)
        # the optimizer step's moment: mixed precision's fp32 gradients of the masters
        # always, the step's own temporaries where calibration measured them (a GPU's)
        return dict(runtime=runtime,
                    host_is_device=self.host_is_device,
                    staging=self.staging.get("disk" if plan.offload == "disk" else zero,
                                             0.0), extra=extra, sp_heap=sp_heap,
                    optimizer_step=self.optimizer_temporaries or 0.0)

    def with_(self, **changes) -> "Cluster":
        return replace(self, **changes)


def _stage_pair(value) -> tuple[float, float]:
    """(a stage before the last's, the last stage's) from one value for all or a pair."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def nearest(table: dict, key: int) -> float:
    """table[key], or the value of the nearest key calibrated (the smaller on a tie); 0 for
    an empty table."""
    if not table:
        return 0.0
    return table[min(table, key=lambda k: (abs(k - key), k))]


def make_cluster(gpu: str | None = None, nodes: int = 1, gpus_per_node: int = 8,
                 gpu_mem: str | float | None = None, intra_bw: str | float | None = None,
                 inter_bw: str | float | None = None, peak_flops: str | float | None = None,
                 precision: str = "bf16", **extra) -> Cluster:
    """A Cluster from a GPU preset and/or explicit quantities (text with units or numbers)."""
    base = lookup(GPUS, gpu, "GPU preset", "--gpu-mem/--peak-flops") if gpu else GPUS["A100-80GB"]
    mem = parse_bytes(gpu_mem) if isinstance(gpu_mem, str) else (gpu_mem or base.mem)
    intra = bandwidth(intra_bw) if isinstance(intra_bw, str) else (intra_bw or LINKS[base.link])
    inter = bandwidth(inter_bw) if isinstance(inter_bw, str) else (inter_bw or LINKS["ib-hdr"])
    # the data sheet's peak at the precision; a part without bf16 tensor cores (a V100)
    # runs bf16 matmuls at its fp32 rate. fp8 runs its block linears at the float8 peak,
    # the rest (attention, the output layer) in bf16, whose peak stays MFU's basis
    fp8 = precision == "fp8"
    if fp8 and not base.peak_fp8:
        raise HardwareError(f"--precision fp8: the {base.name if gpu else 'default ' + base.name}"
                            " has no float8 tensor cores (H100, H200 and L4 have); plan it in "
                            "bf16, or name a card with them (--gpu)")
    default_peak = table_peak(base, "bf16" if fp8 else precision) or base.peak_fp32
    peak = parse_flops(peak_flops) if isinstance(peak_flops, str) else (peak_flops or default_peak)
    return Cluster(nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem=mem, intra_bw=intra,
                   inter_bw=inter, peak_flops=peak, mem_bw=base.mem_bw,
                   fp8_flops=base.peak_fp8 if fp8 else 0.0,
                   name=base.name if gpu else "custom", **extra)
