"""Model FLOPs utilisation (MFU): training FLOPs per token and a device's peak rate.

FLOPs per token for a decoder: 6N + 12*L*d*T (PaLM, appendix B): 6N for the forward and
backward matmuls of N parameters, 12*L*d*T for attention's scores and weighted sum over a
context of T. Recompute is not counted: MFU measures useful model FLOPs, not hardware FLOPs.
The peak comes from the data sheets of known GPUs (core/gpus.py: dense, no sparsity) or, for
a device not in them, a measured matmul; `Peak.source` says which, so every MFU figure states
its basis.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshtrain.core.device import device_name
from meshtrain.core.gpus import GPUS, device_kind, peak_flops


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6N + 12*L*d*T."""
    for name, v in (("n_params", n_params), ("n_layer", n_layer), ("d_model", d_model),
                    ("seq_len", seq_len)):
        if v < 0:
            raise ValueError(f"flops_per_token: {name}={v} must be >= 0")
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def model_flops_per_token(model: torch.nn.Module, seq_len: int, n_layer: int | None = None,
                          d_model: int | None = None, n_params: int | None = None) -> float:
    """FLOPs per token of `model`: N from its parameters (or `n_params`: a mixture of
    experts' active ones, models/experts.active_parameters); L and d from a meshtrain GPT's
    config (`model.config`) or given; a model whose L and d are unknown counts 6N only."""
    n = n_params if n_params is not None else sum(p.numel() for p in model.parameters())
    cfg = getattr(model, "config", None)
    n_layer = n_layer if n_layer is not None else getattr(cfg, "n_layer", 0)
    d_model = d_model if d_model is not None else getattr(cfg, "d_model", 0)
    return flops_per_token(n, n_layer, d_model, seq_len)


@dataclass(frozen=True)
class Peak:
    flops: float
    """Peak FLOP/s of one device."""
    source: str
    """'table: <device> <dtype>' or 'measured: <n>x<n> matmul on <device>'."""


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "fp32")


def table_peak(device_name: str, dtype: torch.dtype) -> Peak | None:
    """The data sheet's peak for a CUDA device of a kind core/gpus.py knows (e.g. 'NVIDIA
    H100 80GB HBM3' is an H100-80GB), or None. fp32 on Ampere+ is TF32 when torch allows it."""
    gpu = GPUS.get(device_kind(device_name))
    if gpu is None:
        return None
    key = _dtype_key(dtype)
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    flops = peak_flops(gpu, key)
    return Peak(flops, f"table: {gpu.name} {key}") if flops else None


def measured_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 5) -> Peak:
    """Best-of-`reps` FLOP/s of an n x n matmul on `device`: the peak where no table entry is."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):  # the first is warm-up
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return Peak(2.0 * n ** 3 / best, f"measured: {n}x{n} {_dtype_key(dtype)} matmul on {device.type}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The table's peak for a known CUDA device, else a measured matmul."""
    if device.type == "cuda":
        found = table_peak(torch.cuda.get_device_name(device), dtype)
        if found is not None:
            return found
    return measured_peak(device, dtype)


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float, n_devices: int = 1) -> float:
    """Achieved model FLOP/s over the peak of `n_devices` devices."""
    if peak_flops <= 0 or n_devices < 1:
        raise ValueError(f"mfu: peak_flops={peak_flops} and n_devices={n_devices} must be positive")
    return tokens_per_s * flops_per_tok / (peak_flops * n_devices)


# fp8 runs' MFU is against the bf16 peak (torchtitan's convention: float8 speeds the same
# FLOPs up, and only the linears run in it); the source says so, with the card's float8 peak
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def float8_basis(device_name: str | None) -> str:
    """What an fp8 run's MFU is against, said beside its peak's source: the bf16 peak, and
    the card's float8 peak where the data sheets give one (`device_name`: a CUDA device's,
    None for CPU ranks)."""
    gpu = GPUS.get(device_kind(device_name)) if device_name else None
    fp8 = peak_flops(gpu, "fp8") if gpu is not None else None
    return ("fp8 run: MFU against the bf16 peak, as torchtitan reports it"
            + (f"; the card's float8 peak {fp8 / 1e12:.4g} TFLOP/s" if fp8 else ""))


def run_peak(device: torch.device, precision: str) -> Peak:
    """One device's peak for a run's plan precision ('fp32' | 'bf16' | 'fp8'); an fp8 run's
    is the bf16 peak, its source saying so (`float8_basis`)."""
    peak = device_peak(device, PRECISION_DTYPES.get(precision, torch.float32))
    if precision != "fp8":
        return peak
    return Peak(peak.flops, f"{peak.source}; {float8_basis(device_name(device))}")
