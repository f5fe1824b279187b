"""The GPUs meshtrain knows by their data sheets, and the kind a CUDA device name is.

One table serves the planner's presets (`meshtrain plan --gpu H100-80GB`), the MFU's peak
(core/flops.py) and the name a calibrated profile is saved under (planner/profile.py), so
that a device is the same part everywhere. Peaks are dense (no sparsity), SXM parts where a
GPU comes in several forms; a form with other figures (an H100 PCIe or NVL, an H200 NVL) is
another kind, which the MFU measures and a profile calibrates."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    mem: float          # bytes
    peak_bf16: float    # dense FLOP/s at 16-bit (fp16 tensor cores on V100)
    peak_fp32: float    # dense FLOP/s at fp32 without TF32
    link: str           # the intra-node link preset it ships with (planner/hardware.LINKS)
    mem_bw: float       # device memory bytes/s
    peak_tf32: float | None = None   # dense FLOP/s of fp32 matmuls on TF32 tensor cores
    bf16: bool = True   # bf16 on tensor cores (V100 has fp16 only)
    peak_fp8: float | None = None   # dense FLOP/s of float8 matmuls (None: no fp8 tensor cores)


# Vendor data sheets: A100 (NVIDIA A100 Tensor Core GPU datasheet, 2021: 312 TFLOPS bf16 dense,
# 156 TF32, 19.5 fp32); H100 SXM (H100 datasheet, 2023: 989 TFLOPS bf16 dense, 494.5 TF32,
# 67 fp32); H200 SXM (H200 datasheet, 2024: the H100's compute, 141 GB of HBM3e at 4.8 TB/s);
# V100 SXM2 (V100 datasheet: 125 TFLOPS fp16 tensor core, 15.7 fp32; no bf16, no TF32);
# L4 (L4 datasheet: 121 TFLOPS bf16 dense, 60 TF32, 30.3 fp32, 300 GB/s); A10G (AWS's G5
# part, no NVIDIA sheet: 70 TFLOPS bf16, 35 TF32, 31.2 fp32 as commonly quoted, 600 GB/s).
# Memory bandwidth from the same sheets. Float8 (e4m3/e5m2 tensor cores, Hopper and Ada):
# H100 and H200 SXM 1,979 TFLOPS dense (the sheets' 3,958 is with sparsity), L4 242.5 (485
# with sparsity); the Ampere and Volta parts have none.
GPUS = {
    "A100-40GB": GPU("A100-40GB", 40e9, 312e12, 19.5e12, "nvlink3", 1.555e12, 156e12),
    "A100-80GB": GPU("A100-80GB", 80e9, 312e12, 19.5e12, "nvlink3", 2.0e12, 156e12),
    "H100-80GB": GPU("H100-80GB", 80e9, 989e12, 67e12, "nvlink4", 3.35e12, 494.5e12,
                      peak_fp8=1979e12),
    "H200-141GB": GPU("H200-141GB", 141e9, 989e12, 67e12, "nvlink4", 4.8e12, 494.5e12,
                       peak_fp8=1979e12),
    "V100-32GB": GPU("V100-32GB", 32e9, 125e12, 15.7e12, "nvlink2", 0.9e12, bf16=False),
    "L4-24GB": GPU("L4-24GB", 24e9, 121e12, 30.3e12, "pcie4", 0.3e12, 60e12, peak_fp8=242.5e12),
    "A10G-24GB": GPU("A10G-24GB", 24e9, 70e12, 31.2e12, "pcie4", 0.6e12, 35e12),
}

# CUDA device names (torch.cuda.get_device_name) -> the GPUS entry whose figures hold for the
# part: (key, tokens the name must hold, tokens that mark another part's figures). An H100
# PCIe or NVL (756 / 835 TFLOPS bf16), an H200 NVL and a V100 PCIe (112 TFLOPS) are other
# kinds; an A100 PCIe has the SXM part's peak (its 80 GB's memory is 3% slower).
_KIND_NAMES = (("H100-80GB", ("h100",), ("pcie", "nvl")),
               ("H200-141GB", ("h200",), ("nvl",)),
               ("A100-80GB", ("a100", "80gb"), ()),
               ("A100-40GB", ("a100", "40gb"), ()),
               ("V100-32GB", ("v100", "32gb"), ("pcie",)),
               ("L4-24GB", ("l4",), ()),
               ("A10G-24GB", ("a10g",), ()))


def device_kind(device_name: str | None, cpus: int | None = None) -> str:
    """The kind of a device: the GPUS key for a CUDA device name the table describes
    ("NVIDIA H100 80GB HBM3" -> "H100-80GB"), else the name as a lower-case slug without
    the vendor ("NVIDIA H100 PCIe" -> "h100-pcie"); CPU ranks (no device name)
    "cpu-<cores>": a profile measured on 2 cores says nothing of 64."""
    if device_name is None:
        return f"cpu-{cpus}"
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    slug = re.sub(r"^(nvidia-)?(tesla-)?", "", slug)
    tokens = set(slug.split("-"))
    for key, needed, other in _KIND_NAMES:
        if tokens >= set(needed) and not tokens & set(other):
            return key
    return slug or "unknown-gpu"


def peak_flops(gpu: GPU, dtype: str) -> float | None:
    """The data sheet's dense peak for matmuls in `dtype` ('bf16', 'fp16', 'fp32', 'tf32',
    'fp8'), or None where the part has no tensor cores for it (bf16 on a V100, float8 before
    Hopper and Ada; TF32 before Ampere runs at the fp32 peak)."""
    if dtype == "fp8":
        return gpu.peak_fp8
    if dtype == "fp16" or (dtype == "bf16" and gpu.bf16):
        return gpu.peak_bf16
    if dtype == "tf32":
        return gpu.peak_tf32 or gpu.peak_fp32
    return gpu.peak_fp32 if dtype == "fp32" else None
