"""Slot 1 with tp > 1: how each parameter is split over the tp ranks, by name.

`TensorParallel` implements the `LayerSharding` protocol (strategies/slots.py) for a model
whose layers were swapped for tensor-parallel ones in place (gpt.py, tp_plan.py): it turns
a rank's slices into whole tensors and back (parameters, and optimizer states shaped like
them), says which parameters a sum over tp counts once, sums the gradients that sequence
parallel leaves partial, and makes the loss vocab-parallel where the output layer is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from meshtrain.core.comm import Comm
from meshtrain.core.regions import Box, Region, whole
from meshtrain.strategies.tensor_parallel.communications import gather_from_tp
from meshtrain.strategies.tensor_parallel.cross_entropy import (VocabParallelLoss, logits_of,
                                                                token_cross_entropy)

AXIS = "tp"


@dataclass(frozen=True)
class Split:
    """A tensor split over T ranks along `dim`, whose size there is `full`, padded with
    zeros to `padded` (a multiple of T; only a vocabulary is padded). With `blocks` > 1 the
    dim holds that many equal fused parts (q, k, v), each split on its own: rank i holds
    [part_0 slice i, part_1 slice i, ...]."""
    dim: int
    full: int
    padded: int
    blocks: int = 1

    def local(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s slice of the whole tensor (a copy; no communication)."""
        if self.padded > self.full:
            pad = [0, 0] * (whole.dim() - 1 - self.dim) + [0, self.padded - self.full]
            whole = F.pad(whole, pad)
        parts = whole.chunk(self.blocks, self.dim)
        return torch.cat([p.chunk(size, self.dim)[rank] for p in parts], self.dim).clone()

    def starts(self, size: int) -> list[tuple[int, int, int]]:
        """(rank, block, start along dim) of every rank's part of every block."""
        part = self.padded // self.blocks // size
        return [(r, b, b * self.padded // self.blocks + r * part)
                for b in range(self.blocks) for r in range(size)]

    def region(self, shape: tuple[int, ...], rank: int, size: int) -> Region:
        """Which parts of the whole tensor rank `rank`'s slice holds (the padding: none)."""
        part = self.padded // self.blocks // size
        local = tuple(self.blocks * part if d == self.dim else n for d, n in enumerate(shape))
        boxes = []
        for r, b, start in self.starts(size):
            length = min(part, self.full - start)
            if r != rank or length <= 0:
                continue
            offsets, sizes, at = [0] * len(shape), list(shape), [0] * len(shape)
            offsets[self.dim], sizes[self.dim], at[self.dim] = start, length, b * part
            boxes.append(Box(tuple(offsets), tuple(sizes), tuple(at)))
        return Region(local, tuple(boxes))

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's slice stacked in rank order: (T, *slice)."""
        size = gathered.shape[0]
        slices = gathered.unbind(0)
        per_block = [s.chunk(self.blocks, self.dim) for s in slices]     # [rank][block]
        whole = torch.cat([per_block[r][b] for b in range(self.blocks) for r in range(size)],
                          self.dim)
        return whole.narrow(self.dim, 0, self.full)


class TensorParallel:
    """Slot 1 over the tp axis: `splits` names every split parameter; any other is
    replicated. `partial` names the parameters whose gradients each rank holds only a part
    of (sequence parallel's LayerNorms and row-parallel biases). A vocab-parallel output
    layer over a vocabulary of `vocab` has this rank's columns from `vocab_start` (both None:
    no such layer)."""

    replicas: dict = {}   # every parameter is replicated over the whole dp axis

    def __init__(self, comm: Comm, splits: dict[str, Split], partial: set[str],
                 vocab_start: int | None = None, vocab: int | None = None) -> None:
        self.comm, self.splits, self.partial = comm, splits, partial
        self.vocab_start, self.vocab = vocab_start, vocab
        self.rank, self.size = comm.mesh.axis_rank(AXIS), comm.mesh.size(AXIS)

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        split = self.splits.get(name)
        if split is None:
            return local
        flat = local.contiguous().view(-1)
        gathered = torch.empty(self.size * flat.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(gathered, flat, AXIS, tag="state")
        return split.assemble(gathered.view(self.size, *local.shape))

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        split = self.splits.get(name)
        return full if split is None else split.local(full, self.rank, self.size)

    def region(self, name: str, shape: tuple[int, ...]) -> Region:
        split = self.splits.get(name)
        return whole(shape) if split is None else split.region(shape, self.rank, self.size)

    def cuts(self, name: str, shape: tuple[int, ...]) -> list[list[int]]:
        split = self.splits.get(name)
        along = [] if split is None else sorted({s for _, _, s in split.starts(self.size)})
        return [along if split is not None and d == split.dim else [] for d in range(len(shape))]

    def counts(self, name: str) -> bool:
        return name in self.splits or self.rank == 0

    def sum_partial_gradients(self, reduced: Callable[[str], torch.Tensor | None]) -> None:
        """One all-reduce over tp of every partial gradient, flattened together."""
        grads = [g for g in (reduced(n) for n in sorted(self.partial)) if g is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, AXIS, tag="partial-grads")
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """With a vocab-parallel output layer: the mean token cross-entropy (the GPT's `loss`,
        or `token_cross_entropy`) becomes vocab-parallel; any other loss gets the logits
        gathered over tp first (correct for any loss, but the full logits then exist)."""
        if self.vocab_start is None:
            return loss_fn
        if is_token_cross_entropy(loss_fn):
            return VocabParallelLoss(self.vocab_start, self.comm)
        return GatheredLogitsLoss(loss_fn, self.comm, self.vocab)


def is_token_cross_entropy(loss_fn: Callable) -> bool:
    from meshtrain.models.gpt import GPT

    return loss_fn is token_cross_entropy or getattr(loss_fn, "__func__", None) is GPT.loss


class GatheredLogitsLoss:
    """A loss that needs the whole logits: all-gather them over tp (split in backward),
    drop the vocabulary padding, then call `loss_fn`."""

    def __init__(self, loss_fn: Callable, comm: Comm, vocab: int) -> None:
        self.loss_fn, self.comm, self.vocab = loss_fn, comm, vocab

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits = gather_from_tp(logits_of(output), self.comm, -1, "loss")[..., :self.vocab]
        if hasattr(output, "_replace"):   # a named tuple (models/moe_stages.Routed)
            return self.loss_fn(output._replace(logits=logits), targets)
        if hasattr(output, "logits"):
            output.logits = logits
            return self.loss_fn(output, targets)
        return self.loss_fn(logits, targets)
