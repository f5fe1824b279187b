"""Shared pieces of the DDP tests: one tiny GPT, one data stream, a training loop that runs
the same way in one process (the reference) and on every rank."""
import torch

import meshtrain as mt
from meshtrain.data.sampler import BatchSampler
from meshtrain.models.gpt import GPT, GPTConfig

# bias=False: a key bias shifts every score of a query equally, so softmax cancels it and its
# true gradient is 0; Adam divides the round-off left there by its own tiny norm, turning
# 1e-10 noise into lr-sized steps. Without biases every parameter has a real gradient.
CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False)
GLOBAL_BATCH = 16


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, CONFIG.vocab_size, (4096,), generator=g, dtype=torch.uint8)


def train(plan: "mt.Plan", steps: int = 10, seed: int = 0, lr: float = 1e-2, **trainer_kw):
    """Train the tiny GPT for `steps` AdamW steps; return (losses, final state, trainer)."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    trainer = mt.Trainer(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
                         **trainer_kw)
    sampler = BatchSampler(data(), GLOBAL_BATCH, CONFIG.seq_len, seed=seed,
                           dp_rank=trainer.dp_rank, dp_size=trainer.dp_size)
    losses = [trainer.step(*sampler.batch(s)) for s in range(steps)]
    return losses, trainer.full_state_dict(), trainer
