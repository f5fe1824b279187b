"""What every benchmark rank shares: its device, the batch on it, a timing fence that waits
for the device, and the tokens/s and MFU of a measured step.

A bench rank computes where a training rank does (core/device.py: MESHTRAIN_DEVICE, then
LOCAL_RANK), so PyTorch's side of a comparison runs on the same device as meshtrain's, with
its batch and model put there: on CUDA no host tensor reaches NCCL, and a step is timed only
once the device has finished it (CUDA queues work; the host clock alone times launches).

MFU counts useful model FLOPs (core/flops.py: 6N + 12*L*d*T per token) against the peak of
every device the step ran on: the table's for a known GPU, else a matmul measured on this
rank's device (the report says which).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from meshtrain.core.device import rank_device, synchronize
from meshtrain.core.flops import mfu, model_flops_per_token, run_peak
from meshtrain.models.gpt import GPT, gpt_config


def bench_device() -> torch.device:
    """This rank's device, as a training rank's (LOCAL_RANK's GPU on CUDA)."""
    return rank_device()


def gpt_batch(model_name: str, batch: int, device: torch.device, seed: int = 0,
              **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `batch` random sequences for the GPT preset, on `device`."""
    cfg = gpt_config(model_name, **overrides)
    g = torch.Generator().manual_seed(seed)   # the same tokens on every device
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g,
                           device="cpu").to(device)
    return tokens[:, :-1], tokens[:, 1:]


def fence(device: torch.device, barrier: bool = True) -> Callable[[], None]:
    """What a timed step waits for at each end: this device's queued work, then (with
    `barrier`) every rank."""
    def wait() -> None:
        synchronize(device)
        if barrier:
            dist.barrier()
    return wait


def flops_basis(model_name: str, device: torch.device, precision: str = "fp32",
                **overrides) -> dict:
    """FLOPs per token of the GPT preset and one device's peak, with its source."""
    cfg = gpt_config(model_name, **overrides)
    peak = run_peak(device, precision)
    return {"flops_per_token": model_flops_per_token(GPT(cfg), cfg.seq_len),
            "peak_flops": peak.flops, "peak_source": peak.source}


def throughput(step_s: float, tokens_per_step: int, basis: dict, devices: int) -> dict:
    """Tokens per second of a step of `tokens_per_step` tokens (the global batch), and its
    MFU over `devices` devices."""
    tokens_per_s = tokens_per_step / step_s
    return {"tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, basis["flops_per_token"], basis["peak_flops"], devices)}


def basis_line(basis: dict) -> str:
    return (f"MFU = tokens/s x {basis['flops_per_token']:.3g} FLOPs/token (6N + 12LdT) over "
            f"every rank's peak ({basis['peak_flops'] / 1e9:.1f} GFLOP/s each, "
            f"{basis['peak_source']})")
