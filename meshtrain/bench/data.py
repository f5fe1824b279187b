"""`meshtrain bench data`: windows per second the loader delivers to one rank, against the
windows per second a training step of the GPT consumes there.

One process plays dp rank 0 of `world`: its loader reads its rows of each global batch
(BatchSampler over memory-mapped shards: a new step's random windows every call) and a plain
PyTorch step of the GPT preset (forward, backward, AdamW) trains on a batch of the same
shape. The two alternate (bench/timing.py); the loader's rate over the step's is the
headroom: above 1 the loader never holds training up. Without --data, the shards are 2**24
random tokens written to a temporary folder.
"""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import numpy as np
import torch

from meshtrain.bench.timing import alternate, median
from meshtrain.data.sampler import BatchSampler
from meshtrain.data.shards import write_shard
from meshtrain.data.source import load_data
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.optimizers import default_adamw

SYNTHETIC_TOKENS = 2**24
LOADER, STEP = "loader", "training step"


def run(data: str | None, model: str, batch: int, world: int, steps: int, reps: int,
        warmup: int, progress) -> dict:
    """Median seconds per local batch of the loader and of a step, and their rates."""
    config = gpt_config(model)
    local = batch // world
    with tempfile.TemporaryDirectory() as tmp:
        if data is None:
            tokens = np.random.default_rng(0).integers(0, config.vocab_size, SYNTHETIC_TOKENS)
            write_shard(Path(tmp) / "synthetic.bin", tokens, np.uint16)
            data = str(Path(tmp) / "synthetic.bin")
        source = load_data(data)
        sampler = BatchSampler(source.train, batch, config.seq_len, seed=0, dp_rank=0,
                               dp_size=world, weights=source.weights)
        counter = itertools.count()
        progress(f"bench data: {source.source}; {model} at {local} x {config.seq_len} per rank")
        times = alternate({LOADER: lambda: sampler.batch(next(counter)),
                           STEP: _gpt_step(config, local)},
                          steps, reps, warmup, sync=lambda: None)
    result = {"data": source.source, "model": model, "world": world, "local_batch": local,
              "seq_len": config.seq_len}
    for name, seconds in times.items():
        s = median(seconds)
        result[name] = {"median_s": s, "windows_per_s": local / s,
                        "tokens_per_s": local * config.seq_len / s}
    result["headroom"] = result[LOADER]["windows_per_s"] / result[STEP]["windows_per_s"]
    return result


def _gpt_step(config, local: int):
    torch.manual_seed(0)
    model = GPT(config)
    opt = default_adamw(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, config.vocab_size, (local, config.seq_len + 1), generator=g,
                      device="cpu")   # the model is on the CPU: this bench times the host
    x, y = w[:, :-1], w[:, 1:]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def format_report(r: dict) -> str:
    lines = [f"data: {r['data']}",
             f"one rank of {r['world']}: {r['local_batch']} windows of {r['seq_len']} tokens "
             f"per step ({r['model']})",
             f"{'':16}{'median':>12}{'windows/s':>14}{'tokens/s':>16}"]
    for name in (LOADER, STEP):
        v = r[name]
        lines.append(f"{name:16}{v['median_s'] * 1e3:>10.3f}ms{v['windows_per_s']:>14,.0f}"
                     f"{v['tokens_per_s']:>16,.0f}")
    lines.append(f"headroom: the loader delivers {r['headroom']:,.0f}x the windows a step "
                 "consumes")
    return "\n".join(lines)
