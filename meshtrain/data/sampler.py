"""Batches of token windows (bytes, or a token dataset's ids) that depend only on (seed,
step), sharded over data-parallel ranks.

[Note: one global batch] Every rank draws the same global batch of offsets for a step from a
generator seeded by (seed, step), then reads only its own contiguous rows. So N ranks
together see exactly the rows one process sees, in the same order, under any dp, pp or tp,
and resuming at step s reproduces the batches an uninterrupted run would have drawn: the
data's position is the step (`position`, which every checkpoint records beside the data's
identity), with no loader state beyond it.
"""
from __future__ import annotations

import hashlib

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


class TensorTokens:
    """A 1-D tensor held in memory (the byte corpus) read as a token stream."""

    def __init__(self, data: torch.Tensor) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be a 1-D tensor of tokens, got shape {tuple(data.shape)}")
        self.data = data

    def numel(self) -> int:
        return self.data.numel()

    def num_windows(self, seq_len: int) -> int:
        return max(0, self.data.numel() - seq_len)

    def read(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        return self.data[offsets[:, None] + torch.arange(seq_len + 1)].long()   # (rows, T+1)


def as_tokens(data):
    """A tensor as TensorTokens; a token stream (data/tokens.py) as it is."""
    return TensorTokens(data) if isinstance(data, torch.Tensor) else data


def _check_data(data, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if data.num_windows(seq_len) < 1:
        raise ValueError(f"data has {data.numel()} tokens, fewer than seq_len+1={seq_len + 1} "
                         f"needed for one (input, target) window; use more data or a shorter "
                         f"seq_len")


def _split_windows(w: torch.Tensor, pin_memory: bool = False):
    """(inputs, targets) of windows (rows, T+1): targets are inputs shifted by one; in pinned
    host memory with `pin_memory` (a GPU then copies them without blocking)."""
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()   # contiguous: ready to send
    if pin_memory:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class BatchSampler:
    """Global batch for step s = `batch_size` windows of seq_len+1 tokens at random offsets drawn
    from a torch.Generator seeded by (seed, step), so a batch depends only on (seed, step).
    Data-parallel rank r of N takes rows [r*B/N, (r+1)*B/N) of that global batch and reads
    only those, in pinned host memory with `pin_memory` (as torch's DataLoader: for a GPU to
    copy without blocking). `data`: one token stream (or tensor), or several blended by
    `weights`: each row's dataset drawn with those probabilities, from the same generator."""

    def __init__(self, data, batch_size: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False,
                 weights: list[float] | None = None):
        streams = [as_tokens(d) for d in (data if isinstance(data, (list, tuple)) else [data])]
        for stream in streams:
            _check_data(stream, seq_len)
        if weights is not None and (len(weights) != len(streams) or min(weights) <= 0):
            raise ValueError(f"weights {weights}: give one positive weight per dataset "
                             f"({len(streams)})")
        if batch_size < 1 or dp_size < 1:
            raise ValueError(f"batch_size={batch_size} and dp_size={dp_size} must be >= 1")
        if batch_size % dp_size:
            raise ValueError(f"global batch {batch_size} does not split over dp={dp_size} "
                             f"ranks; use a multiple of {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.streams, self.batch_size, self.seq_len, self.seed = streams, batch_size, seq_len, seed
        self.weights = None if len(streams) == 1 else torch.tensor(
            weights or [1.0] * len(streams), dtype=torch.float64)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch_size = batch_size // dp_size
        self.pin_memory = pin_memory

    def windows(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step` as (dataset, window number) per row, each (batch_size,):
        the same on every rank, under every plan."""
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        g = torch.Generator().manual_seed(step_seed(self.seed, step))
        if self.weights is None:   # one dataset: nanoGPT's uniform offsets
            high = self.streams[0].num_windows(self.seq_len)   # last start keeps T+1 tokens
            offsets = torch.randint(0, high, (self.batch_size,), generator=g)  # (B,) all ranks
            return torch.zeros(self.batch_size, dtype=torch.long), offsets
        which = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)
        highs = torch.tensor([s.num_windows(self.seq_len) for s in self.streams])
        u = torch.rand(self.batch_size, dtype=torch.float64, generator=g)
        return which, (u * highs[which]).long()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for `step`, int64 (batch_size/dp_size, seq_len)."""
        which, offsets = self.windows(step)
        lo = self.dp_rank * self.local_batch_size
        which, offsets = which[lo:lo + self.local_batch_size], offsets[lo:lo + self.local_batch_size]
        w = torch.empty(len(offsets), self.seq_len + 1, dtype=torch.long)
        for d in which.unique().tolist():
            rows = (which == d).nonzero().flatten()
            w[rows] = self.streams[d].read(offsets[rows], self.seq_len)
        return _split_windows(w, self.pin_memory)

    def window_hash(self, step: int) -> str:
        """A short hash of `step`'s global windows: equal hashes, equal batches."""
        which, offsets = self.windows(step)
        return hashlib.sha1(torch.stack([which, offsets]).numpy().tobytes()).hexdigest()[:12]

    def position(self, step: int) -> dict:
        """What a checkpoint records of the data's position: the next batch is a function of
        these alone (see the module's note), so any plan resumes it exactly."""
        return {"next_step": step, "seed": self.seed, "batch_size": self.batch_size,
                "seq_len": self.seq_len}

    def __repr__(self) -> str:
        return (f"BatchSampler(tokens={[s.numel() for s in self.streams]}, "
                f"batch_size={self.batch_size}, seq_len={self.seq_len}, seed={self.seed}, "
                f"dp={self.dp_rank}/{self.dp_size})")


def eval_batches(data: torch.Tensor, batch_size: int, seq_len: int, num_batches: int,
                 pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_batches` fixed (inputs, targets) batches at evenly spaced offsets spanning `data`:
    the same every call, so validation losses are comparable across runs and plans (pinned
    with `pin_memory`, as `BatchSampler`'s)."""
    data = as_tokens(data)
    _check_data(data, seq_len)
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"batch_size={batch_size} and num_batches={num_batches} must be >= 1")
    n = batch_size * num_batches
    last = data.num_windows(seq_len) - 1                  # last start keeps T+1 tokens
    offsets = torch.linspace(0, last, n, dtype=torch.float64).long()   # (n,)
    x, y = _split_windows(data.read(offsets, seq_len), pin_memory)
    return list(zip(x.split(batch_size), y.split(batch_size)))
