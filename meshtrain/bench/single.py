"""`meshtrain bench single`: what meshtrain costs on one device, eager and compiled.

Four contenders train the same GPT on the same batch from the same seed, alternating in one
process (bench/timing.py): plain PyTorch eager, plain PyTorch with each block compiled
(strategies/compile.py's `apply_compile`, the same blocks `Plan(compile=True)` compiles),
meshtrain's `Trainer` under `Plan()`, and under `Plan(compile=True)`; on a GPU a fifth,
`Plan(compile="cudagraphs")` (the compiled blocks and loss replayed as CUDA graphs). Every
step ends with the loss on the host (`.item()`, as `Trainer.step` returns it) and is timed between device
synchronisations. In bf16, plain PyTorch runs under autocast and meshtrain with bf16
parameters beside fp32 master weights (`Plan(precision="bf16")`).

Per contender: the median step, tokens/s, MFU (core/flops.py: 6N + 12·L·d·T FLOPs per token
against the device's peak, whose source is stated), its speed over plain eager, and the
last loss (the four do the same work: their losses agree to round-off and compile's
reordering).
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from meshtrain.bench.device import fence, gpt_batch, throughput
from meshtrain.bench.timing import alternate, median
from meshtrain.core.device import DEVICE_ENV
from meshtrain.core.flops import flops_per_token, run_peak
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.strategies.compile import apply_compile
from meshtrain.train.optimizers import default_adamw
from meshtrain.train.trainer import Trainer

TORCH_EAGER, TORCH_COMPILED = "torch eager", "torch compiled"
OURS_EAGER, OURS_COMPILED = "meshtrain Plan()", "meshtrain compile"
OURS_CUDA_GRAPHS = "meshtrain cudagraphs"   # Plan(compile="cudagraphs"): on a GPU only
CONTENDERS = (TORCH_EAGER, TORCH_COMPILED, OURS_EAGER, OURS_COMPILED)
LR = 1e-4


def default_model(device: str) -> str:
    """GPT-2 124M's shape on a GPU; a small GPT on the CPU (the bench in about a minute)."""
    return "gpt2-124m" if device == "cuda" else "tiny"


def _optimizer(params):
    return default_adamw(params, lr=LR, weight_decay=0.0)


def _plain(config, device: torch.device, precision: str, backend: str | None, x, y):
    torch.manual_seed(0)
    model = GPT(config).to(device)
    apply_compile(model, backend)
    opt = _optimizer(model.parameters())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
              else nullcontext()):
            logits = model(x)
        loss = model.loss(logits.float(), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _ours(config, precision: str, backend: str | None, x, y):
    torch.manual_seed(0)
    trainer = Trainer(GPT(config), Plan(precision=precision, compile=backend or False),
                      optimizer=_optimizer)
    return lambda: trainer.step(x, y)


def summarise(times: dict[str, list[float]], tokens_per_step: int, flops_per_tok: float,
              peak_flops: float) -> dict[str, dict]:
    """Per contender from its step times: median step, tokens/s, MFU and speed over plain
    eager (its step time over this one's: above 1 is faster)."""
    base = median(times[TORCH_EAGER])
    basis = {"flops_per_token": flops_per_tok, "peak_flops": peak_flops}
    rows = {}
    for name, steps in times.items():
        step = median(steps)
        rows[name] = {"step_s": step, **throughput(step, tokens_per_step, basis, devices=1),
                      "vs_torch_eager": base / step}
    return rows


def run(device: str = "cpu", model_name: str | None = None, batch: int = 16,
        precision: str | None = None, backend: str = "inductor", steps: int = 5,
        reps: int = 10, warmup: int = 3, progress=print) -> dict:
    """The four contenders on `device` ("cpu" | "cuda", resolved), alternating."""
    os.environ[DEVICE_ENV] = device   # where the Trainer's one-rank mesh computes
    where = torch.device(device)
    model_name = model_name or default_model(device)
    precision = precision or ("bf16" if device == "cuda" else "fp32")
    config = gpt_config(model_name)
    x, y = gpt_batch(model_name, batch, where)
    progress(f"{model_name} GPT, batch {batch} x {config.seq_len}, {precision} on {device}: "
             f"{', '.join(CONTENDERS)}; compiling {backend} in warm-up ...")
    contenders = {TORCH_EAGER: _plain(config, where, precision, None, x, y),
                  TORCH_COMPILED: _plain(config, where, precision, backend, x, y),
                  OURS_EAGER: _ours(config, precision, None, x, y),
                  OURS_COMPILED: _ours(config, precision, backend, x, y)}
    if device == "cuda" and backend == "inductor":
        contenders[OURS_CUDA_GRAPHS] = _ours(config, precision, "cudagraphs", x, y)
    losses = {}

    def last_loss(name):
        return lambda: losses.__setitem__(name, contenders[name]())
    times = alternate({n: last_loss(n) for n in contenders}, steps, reps, max(1, warmup),
                      sync=fence(where, barrier=False))
    peak = run_peak(where, precision)
    per_token = flops_per_token(config.num_params(), config.n_layer, config.d_model,
                                config.seq_len)
    rows = summarise(times, batch * config.seq_len, per_token, peak.flops)
    for name in rows:
        rows[name]["last_loss"] = losses[name]
    return {"model": model_name, "device": device, "precision": precision, "batch": batch,
            "seq_len": config.seq_len, "backend": backend, "steps": steps, "reps": reps,
            "flops_per_token": per_token, "peak_flops": peak.flops, "peak_source": peak.source,
            "contenders": rows,
            "compile_speedup": compile_speedup(rows)}


def compile_speedup(rows: dict[str, dict]) -> dict[str, float]:
    """Each side's eager step time over its compiled one (above 1: compile is faster)."""
    out = {"torch": rows[TORCH_EAGER]["step_s"] / rows[TORCH_COMPILED]["step_s"],
           "meshtrain": rows[OURS_EAGER]["step_s"] / rows[OURS_COMPILED]["step_s"]}
    if OURS_CUDA_GRAPHS in rows:
        out[OURS_CUDA_GRAPHS] = rows[OURS_EAGER]["step_s"] / rows[OURS_CUDA_GRAPHS]["step_s"]
    return out


def format_report(result: dict) -> str:
    lines = [f"model {result['model']} GPT, batch {result['batch']} x {result['seq_len']}, "
             f"{result['precision']} on {result['device']}, AdamW, compile backend "
             f"{result['backend']}; median step of {result['reps']} alternating repetitions x "
             f"{result['steps']} steps",
             f"  {'contender':<20} {'step':>10} {'tokens/s':>11} {'MFU':>7} "
             f"{'x torch eager':>14} {'last loss':>10}"]
    for name, row in result["contenders"].items():
        lines.append(f"  {name:<20} {row['step_s'] * 1e3:>8.1f}ms {row['tokens_per_s']:>11,.0f} "
                     f"{row['mfu'] * 100:>6.2f}% {row['vs_torch_eager']:>14.3f} "
                     f"{row['last_loss']:>10.4f}")
    speedup = result["compile_speedup"]
    graphs = (f", meshtrain with CUDA graphs {speedup[OURS_CUDA_GRAPHS]:.3f}x"
              if OURS_CUDA_GRAPHS in speedup else "")
    lines += [f"compile's speed-up over its own eager: torch {speedup['torch']:.3f}x, "
              f"meshtrain {speedup['meshtrain']:.3f}x{graphs}",
              f"MFU: {result['flops_per_token']:.3g} FLOPs/token (6N + 12·L·d·T) against "
              f"{result['peak_flops'] / 1e12:.4g} TFLOP/s ({result['peak_source']})"]
    return "\n".join(lines)

