"""`meshtrain bench recipe`: a Llama-3-shaped transformers model on one device, meshtrain's
best plan against the torchtitan recipe assembled from PyTorch's own parts.

The two sides train the same model (transformers' `LlamaForCausalLM` from one config and one
seed) on the same batch and sequence length:

- meshtrain: `Trainer` under `Plan(precision, compile, recompute="selective")` with fused
  AdamW where the device has it (train/optimizers.py), the model's own token loss;
- the recipe (torchtitan's `parallelize_llama` on one GPU, in its order): float8 linears
  where asked (torchao), each decoder layer wrapped in `checkpoint_wrapper` with PyTorch's
  selective activation checkpointing (`create_selective_checkpoint_contexts`, keeping the
  outputs of the same op list, strategies/recompute.py's SAVED_OPS, recomputing the rest),
  each layer `torch.compile`d, then FSDP2 (`fully_shard` per layer and on the whole model,
  over a one-rank mesh, bf16 parameters and fp32 reductions), AdamW over the fp32 shards,
  the loss as cross-entropy on fp32 logits.

Each side is built, warmed up (compiled) and its peak memory measured alone (on CUDA: the
allocator's peak during one step, above what was allocated before the side was built, so
the other side's state is not counted); then their steps alternate (bench/timing.py), each
ending with the loss on the host. Per side: the median step, tokens/s (the batch's tokens
over it), MFU (core/flops.py's FLOPs per token over the device's peak, whose source is
stated) and the last loss; ratios are meshtrain's over the recipe's. float8 runs both
sides eagerly (compiled float8 blocks are checked on a CPU only, not yet timed on a GPU).

On a GPU the model is Llama 3.2 1B's shape at 4,096 tokens (`--size 1b`); on the CPU a
tiny Llama of the same family (`--size tiny`), so that the bench runs in the tests.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from meshtrain.bench.device import bench_device, throughput
from meshtrain.bench.timing import alternate, median
from meshtrain.core.device import DEVICE_ENV, device_memory, reset_peak, synchronize
from meshtrain.core.flops import model_flops_per_token, run_peak
from meshtrain.core.plan import Plan
from meshtrain.strategies.recompute import SAVED_OPS
from meshtrain.train.optimizers import default_adamw
from meshtrain.train.trainer import Trainer

OURS, RECIPE = "meshtrain", "recipe"
LR = 1e-4
# Llama 3.2 1B (meta-llama/Llama-3.2-1B's config.json): 1.24B parameters, tied embeddings
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                rope_theta=500000.0, tie_word_embeddings=True)
# the same family at a size the CPU trains in well under a second a step
LLAMA_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                  tie_word_embeddings=True)
# a large vocabulary, untied: a head heavy in compute beside an embedding heavy in parameters
# only (bench/pipeline.bench_balance: stages balanced by compute against by parameters)
LLAMA_WIDE_VOCAB = dict(vocab_size=32000, hidden_size=256, intermediate_size=688,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        rope_theta=500000.0, tie_word_embeddings=False)
SIZES = {"1b": LLAMA_1B, "tiny": LLAMA_TINY, "wide-vocab": LLAMA_WIDE_VOCAB}


def llama_config(size: str, seq: int):
    """transformers' LlamaConfig of `size` ("1b" | "tiny") for sequences of `seq` tokens:
    no dropout, no KV cache (training), fused attention (sdpa)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES[size], max_position_embeddings=max(seq, 128), use_cache=False,
                       attention_dropout=0.0, rms_norm_eps=1e-5,
                       attn_implementation="sdpa")


def _build(config, device: torch.device) -> nn.Module:
    """The model both sides start from: the same seed, built where it trains."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def _ours(config, device, precision: str, backend: str | None, x, y):
    plan = Plan(precision=precision, compile=backend or False, recompute="selective",
                fp8_emulate=precision == "fp8" and device.type != "cuda")
    trainer = Trainer(_build(config, device), plan,
                      optimizer=lambda ps: default_adamw(ps, lr=LR, weight_decay=0.0))
    return lambda: trainer.step(x, y)


def _selective_policy(ctx, op, *args, **kwargs):
    """torchtitan's selective checkpointing policy over the same op list as meshtrain's."""
    from torch.utils.checkpoint import CheckpointPolicy

    return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def _recipe(config, device, precision: str, backend: str | None, x, y):
    """torchtitan's recipe on one device: float8, selective checkpointing, compile, FSDP2,
    in that order (torchtitan's `parallelize_llama`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build(config, device)
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=device.type != "cuda"),
            module_filter_fn=lambda m, name: name != "lm_head")
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer = checkpoint_wrapper(layer, context_fn=_selective_contexts,
                                   preserve_rng_state=False)
        if backend is not None:
            layer = torch.compile(layer, backend=backend)
        layers[i] = layer
    mesh = init_device_mesh(device.type, (1,))
    mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if precision != "fp32" else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    optimizer = default_adamw(model.parameters(), lr=LR, weight_decay=0.0)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def _warm_and_peak(step, device: torch.device, before: int, warmup: int) -> int | None:
    """Warm a side up (its first steps compile), then its peak bytes in one more step above
    `before` (what was allocated before it was built); None on the CPU (no allocator
    peak: the process's would count both sides)."""
    for _ in range(max(1, warmup)):
        step()
    synchronize(device)
    reset_peak(device)
    step()
    synchronize(device)
    memory = device_memory(device)
    return None if memory is None else memory["device_peak"] - before


def bench_rank(size: str, batch: int, seq: int, precision: str, backend: str | None,
               steps: int, reps: int, warmup: int) -> dict:
    """On the one rank: build, warm and measure each side alone, then alternate them."""
    device = bench_device()
    config = llama_config(size, seq)
    g = torch.Generator().manual_seed(0)   # the same tokens on every device
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    backend = None if precision == "fp8" else backend   # see the module's docstring
    sides, peaks, losses = {}, {}, {}
    for name, build in ((RECIPE, _recipe), (OURS, _ours)):
        memory = device_memory(device)
        before = 0 if memory is None else memory["device_allocated"]
        step = build(config, device, precision, backend, x, y)
        sides[name] = lambda n=name, s=step: losses.__setitem__(n, s())
        peaks[name] = _warm_and_peak(sides[name], device, before, warmup)
    times = alternate(sides, steps, reps, 0, sync=lambda: synchronize(device))
    peak = run_peak(device, precision)
    return {"size": size, "batch": batch, "seq": seq, "precision": precision,
            "compile": backend, "steps": steps, "reps": reps, "device": str(device),
            "tokens_per_step": batch * seq,
            "flops_per_token": model_flops_per_token(_build(config, "meta"), seq,
                                                     config.num_hidden_layers,
                                                     config.hidden_size),
            "peak_flops": peak.flops, "peak_source": peak.source,
            "times": times, "peak_bytes": peaks, "last_loss": losses}


def summarise(raw: dict) -> dict:
    """Per side from its step times: median step, tokens/s (the step's tokens over it) and
    MFU (FLOPs per token x tokens/s over the peak); ratios meshtrain over the recipe."""
    rows = {}
    for name, times in raw["times"].items():
        step_s = median(times)
        rows[name] = {"step_s": step_s, **throughput(step_s, raw["tokens_per_step"], raw, 1),
                      "peak_bytes": raw["peak_bytes"][name], "last_loss": raw["last_loss"][name]}
    ours, theirs = rows[OURS], rows[RECIPE]
    ratios = {"tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
              "mfu": ours["mfu"] / theirs["mfu"],
              "peak_bytes": (ours["peak_bytes"] / theirs["peak_bytes"]
                             if ours["peak_bytes"] and theirs["peak_bytes"] else None)}
    return {**{k: v for k, v in raw.items() if k not in ("times", "peak_bytes", "last_loss")},
            "sides": rows, "ratios": ratios, "all_times": raw["times"]}


def run(device: str = "cpu", size: str | None = None, batch: int = 1, seq: int | None = None,
        precision: str | None = None, backend: str | None = "inductor", steps: int = 3,
        reps: int = 4, warmup: int = 2, progress=print) -> dict:
    """The bench on one rank of `device` ("cpu" | "cuda", resolved): Llama 3.2 1B's shape
    at 4,096 tokens in bf16 on a GPU, a tiny Llama at 128 in fp32 on the CPU, by default."""
    from meshtrain.launch import launch

    os.environ[DEVICE_ENV] = device   # where the one rank (and the Trainer's mesh) computes
    size = size or ("1b" if device == "cuda" else "tiny")
    seq = seq or (4096 if size == "1b" else 128)
    precision = precision or ("bf16" if device == "cuda" else "fp32")
    progress(f"Llama ({size}) batch {batch} x {seq}, {precision} on {device}: meshtrain vs "
             f"the torchtitan recipe, compile {backend or 'none'} in warm-up ...")
    raw = launch(bench_rank, 1, (size, batch, seq, precision, backend, steps, reps,
                                 warmup))[0]
    return summarise(raw)


def format_report(result: dict) -> str:
    lines = [f"Llama ({result['size']}), batch {result['batch']} x {result['seq']}, "
             f"{result['precision']} on {result['device']}, compile {result['compile']}, "
             f"selective recomputation, AdamW; median step of {result['reps']} alternating "
             f"repetitions x {result['steps']} steps",
             f"  {'side':<10} {'step':>10} {'tokens/s':>11} {'MFU':>7} {'peak memory':>12} "
             f"{'last loss':>10}"]
    for name, row in result["sides"].items():
        peak = (f"{row['peak_bytes'] / 2**30:.2f} GiB" if row["peak_bytes"] is not None
                else "n/a (CPU)")
        lines.append(f"  {name:<10} {row['step_s'] * 1e3:>8.1f}ms {row['tokens_per_s']:>11,.0f} "
                     f"{row['mfu'] * 100:>6.2f}% {peak:>12} {row['last_loss']:>10.4f}")
    r = result["ratios"]
    memory = f"{r['peak_bytes']:.3f}x" if r["peak_bytes"] is not None else "n/a"
    lines += [f"meshtrain / recipe: tokens/s {r['tokens_per_s']:.3f}x, MFU {r['mfu']:.3f}x, "
              f"peak memory {memory}",
              f"MFU: {result['flops_per_token']:.3g} FLOPs/token (6N + 12·L·d·T) against "
              f"{result['peak_flops'] / 1e12:.4g} TFLOP/s ({result['peak_source']}); the "
              f"recipe: float8 (if asked), per-layer selective checkpointing, per-layer "
              f"torch.compile, FSDP2 fully_shard on one rank, AdamW"]
    return "\n".join(lines)
