"""Batches of byte windows that depend only on (seed, step), sharded over data-parallel ranks.

[Note: one global batch] Every rank draws the same global batch of offsets for a step from a
generator seeded by (seed, step), then keeps its own contiguous rows. So N ranks together see
exactly the rows one process sees, in the same order, and resuming at step s reproduces the
batches an uninterrupted run would have drawn: no sampler state to checkpoint.
"""
from __future__ import annotations

import torch

_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: spreads nearby integers over all 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for (seed, step): distinct pairs give unrelated streams."""
    return _splitmix64(_splitmix64(seed) ^ step) >> 1   # manual_seed takes < 2**63 safely


def _check_data(data: torch.Tensor, seq_len: int) -> None:
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of tokens, got shape {tuple(data.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} tokens, fewer than seq_len+1={seq_len + 1} "
                         f"needed for one (input, target) window; use more data or a shorter "
                         f"seq_len")


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int, pin_memory: bool = False):
    """(inputs, targets), int64 (len(offsets), seq_len): targets are inputs shifted by one;
    in pinned host memory with `pin_memory` (a GPU then copies them without blocking)."""
    idx = offsets[:, None] + torch.arange(seq_len + 1)   # (rows, T+1)
    w = data[idx].long()                                 # (rows, T+1)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()   # contiguous: ready to send
    if pin_memory:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class BatchSampler:
    """Global batch for step s = `batch_size` windows of seq_len+1 tokens at random offsets drawn
    from a torch.Generator seeded by (seed, step), so a batch depends only on (seed, step).
    Data-parallel rank r of N takes rows [r*B/N, (r+1)*B/N) of that global batch, in pinned
    host memory with `pin_memory` (as torch's DataLoader: for a GPU to copy without blocking)."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False):
        _check_data(data, seq_len)
        if batch_size < 1 or dp_size < 1:
            raise ValueError(f"batch_size={batch_size} and dp_size={dp_size} must be >= 1")
        if batch_size % dp_size:
            raise ValueError(f"global batch {batch_size} does not split over dp={dp_size} "
                             f"ranks; use a multiple of {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch_size = batch_size // dp_size
        self.pin_memory = pin_memory

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for `step`, int64 (batch_size/dp_size, seq_len)."""
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        g = torch.Generator().manual_seed(step_seed(self.seed, step))
        high = self.data.numel() - self.seq_len            # last start keeps T+1 tokens
        offsets = torch.randint(0, high, (self.batch_size,), generator=g)  # (B,) all ranks
        lo = self.dp_rank * self.local_batch_size
        return _windows(self.data, offsets[lo:lo + self.local_batch_size], self.seq_len,
                        self.pin_memory)

    def __repr__(self) -> str:
        return (f"BatchSampler(tokens={self.data.numel()}, batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}, seed={self.seed}, dp={self.dp_rank}/{self.dp_size})")


def eval_batches(data: torch.Tensor, batch_size: int, seq_len: int, num_batches: int,
                 pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_batches` fixed (inputs, targets) batches at evenly spaced offsets spanning `data`:
    the same every call, so validation losses are comparable across runs and plans (pinned
    with `pin_memory`, as `BatchSampler`'s)."""
    _check_data(data, seq_len)
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"batch_size={batch_size} and num_batches={num_batches} must be >= 1")
    n = batch_size * num_batches
    last = data.numel() - seq_len - 1                      # last start keeps T+1 tokens
    offsets = torch.linspace(0, last, n, dtype=torch.float64).long()   # (n,)
    x, y = _windows(data, offsets, seq_len, pin_memory)
    return list(zip(x.split(batch_size), y.split(batch_size)))
