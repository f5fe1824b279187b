"""What calibration runs: its budgets, the GPTs it and `--verify` train on each device type,
the reference GPT's runs for the runtime memory, and the plans that measure each strategy's
own costs (`strategy_runs`)."""
from __future__ import annotations

import torch

from meshtrain.planner.profile import REFERENCE_GPT

SIZES = (256, 16 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20)   # bytes per collective
ROUNDS = 5                  # launches per world size, interleaved with the other worlds'
GPU_ROUNDS = 3              # ... on GPUs, which hold their speed (no shared cores' phases)
BUDGET_S = 2.0              # seconds of alternated repetitions per launch
MIN_REPS = 5
MEMORY_BATCHES = (2, 16)    # micro-batches of the runtime-memory calibration on the reference
                            # GPT (far apart: a few MB of noise in a point moves a slope less)
DEEP_POINT = (4, 8)         # ... and (layers, batch) of a deeper one: the heap keeps more of
                            # a micro-batch's first layer than of each further layer's
ACCUMULATION_POINT = (16, 2)   # ... and (batch, micro-batches) of one that accumulates
                            # gradients over micro-batches: its heap keeps more
# What the time model needs of a device, per device type: a square matmul (n, dtype name) for
# its peak where the table has none; GPT-shaped GEMMs (tokens M, K, N) and causal attention
# (batch, heads, seq, head_dim), forward and backward, for efficiency by size; a chain of
# LAUNCH_CHAIN tiny ops for the cost of one op's launch. In the run's dtype: bf16 on CUDA,
# fp32 on CPU, where two small shapes each keep calibration's cost what it was.
SQUARE = {"cuda": (8192, "bf16"), "cpu": (512, "fp32")}
GEMM_SHAPES = {"cuda": ((8192, 1024, 4096), (4096, 2048, 8192), (8192, 4096, 4096),
                        (8192, 4096, 16384), (8192, 8192, 32768)),
               "cpu": ((128, 256, 768), (512, 256, 1024))}
ATTENTION_SHAPES = {"cuda": ((8, 16, 1024, 64), (4, 32, 2048, 128), (1, 64, 8192, 128)),
                    "cpu": ((2, 4, 128, 64), (1, 4, 256, 64))}
LAUNCH_CHAIN = 64
# FLOPs of GEMM or attention work queued between two waits for the device: a small shape's
# one call takes a GPU less time than the host's launch and wait around it (attention at
# 8 x 16 x 1024 x 64 read 13% of an H200's peak timed alone), while a training step queues
# its kernels ahead of the device; so each is repeated up to this much work. CPU ranks
# compute as they dispatch: once.
QUEUED_FLOPS = {"cuda": 2e12, "cpu": 0.0}
COPY_BYTES = {"cuda": 2**29, "cpu": 32 * 2**20}   # the copy timed for memory bandwidth
# The GPTs (GPTConfig's fields) calibration's reference runs and `--verify` train, per device
# type. CPU ranks keep the small ones: there the host's work is the device's. On a GPU their
# step is all host work (Python, autograd, launches: batch 4 ran slower than 16), a regime
# nobody trains in; there, a GPT whose matmuls bound its step at the plans' micro-batches
# (4-16 sequences of 1024 tokens at d_model 2048, a vocabulary a multiple of 64), trained in
# the device's dtype. Its reference has 2 blocks as the CPU's; verification's 4.
GPU_GPT = dict(vocab_size=8192, seq_len=1024, n_layer=2, n_head=16, d_model=2048)
REFERENCE_GPTS = {"cpu": REFERENCE_GPT, "cuda": GPU_GPT}
VERIFY_GPTS = {"cpu": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256),
               "cuda": {**GPU_GPT, "n_layer": 4}}
# The host's side of a GPU step (Python, autograd, launches: what the device's work hides
# until it outlasts it), timed on a GPT so narrow that the device waits on the host: the
# Trainer's step at (layers, micro-batches of one sequence, recompute), apart in what grows
# per step, per layer held and per block a micro-batch runs (fit.fit_host).
HOST_GPT = dict(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64)
HOST_RUNS = ((2, 1, "none"), (8, 1, "none"), (8, 4, "none"), (8, 1, "full"))
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
# the runtime-memory runs in calibration order, (layers, batch, micro-batches): the reference
# GPT at MEMORY_BATCHES, the deeper one, the accumulating one (fit_runtime_memory and
# fit_trainer read them in this order)
MEMORY_RUNS = ([(REFERENCE_GPT["n_layer"], b, 1) for b in MEMORY_BATCHES] + [(*DEEP_POINT, 1)]
               + [(REFERENCE_GPT["n_layer"], *ACCUMULATION_POINT)])


# Each strategy's own runtime costs, on the reference GPT, beside DDP's: (plan, per-rank
# batch). ZeRO's gathers and scatters are staged by a CPU backend in copies of their buffers
# (gloo: up to 3x an all-gather's output), which DDP's in-place all-reduce does not need;
# tensor parallel repeats on every rank the work it does not split.
# (Tensor parallel at each width t that divides the world, the rest of the ranks over dp:
# how much it repeats depends on t, and on how many ranks share the cores.)
def strategy_runs(world: int) -> dict[str, tuple[dict, int]]:
    """name -> (plan, per-rank batch) at `world` ranks."""
    if world == 1:
        return {}
    runs = {f"zero{z}": ({"dp": world, "zero": z}, 2) for z in (1, 2, 3)}
    # the recomputed forward gathers every unit again: staged while backward's are
    runs["zero3r"] = ({"dp": world, "zero": 3, "recompute": "full"}, 8)
    runs["disk"] = ({"dp": world, "zero": 2, "offload": "disk"}, 8)
    for t in range(2, world + 1):
        if world % t == 0:
            runs[f"tp{t}"] = ({"dp": world // t, "tp": t} if t < world else {"tp": t}, 8)
    # sequence parallel: its gathers and scatters along the sequence, staged per layer,
    # on the reference GPT and a deeper one (run_model)
    runs["tp2sp"] = runs["tp2sp_deep"] = ({**runs["tp2"][0], "sequence_parallel": True}, 8)
    if world % 2 == 0:
        runs["pp2"] = ({"dp": world // 2, "pp": 2, "microbatches": 4} if world > 2 else
                       {"pp": 2, "microbatches": 4}, 8)
    if world % 4 == 0:   # tensor parallel inside a pipeline: each stage's collectives
        # beside the other stage's compute
        runs["pp2tp2"] = ({"pp": 2, "tp": 2, "microbatches": 4, "dp": world // 4}, 8)
    return runs


def run_model(name: str, device: str = "cpu") -> dict:
    """The GPT a strategy run trains on `device` ranks: the reference, or with DEEP_POINT's
    blocks ("_deep")."""
    return reference_gpt(device, DEEP_POINT[0] if name.endswith("_deep") else None)


def reference_gpt(device: str, layers: int | None = None) -> dict:
    """Calibration's reference GPT on `device` ("cpu", "cuda") ranks, with `layers` blocks
    (None: its own)."""
    model = REFERENCE_GPTS[device]
    return model if layers is None else {**model, "n_layer": layers}


def optimizer(device: str):
    """The optimizer factory calibration and `--verify` train with: AdamW, fused into one
    kernel on CUDA (what a GPU trains with: no per-tensor launches, no temporaries),
    PyTorch's default elsewhere."""
    fused = {"fused": True} if device == "cuda" else {}
    return lambda params: torch.optim.AdamW(params, lr=1e-3, **fused)


def run_plan(plan: dict, device: str) -> dict:
    """`plan` (Plan's fields) as calibration and `--verify` run it on `device` ranks: in the
    device's dtype (SQUARE's), the dtype its GEMMs and attention were measured in; CPU
    plans unchanged (fp32, Plan's default)."""
    dtype = SQUARE[device][1]
    return plan if dtype == "fp32" else {**plan, "precision": dtype}
