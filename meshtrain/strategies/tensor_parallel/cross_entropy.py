"""Cross-entropy over a vocabulary split across the tp ranks, never gathering the logits.

For logits z (N tokens, V classes) and targets t, the mean token loss is
    L = 1/N Σ_n [ log Σ_v exp(z_nv - m_n) - (z_n,t_n - m_n) ],   m_n = max_v z_nv,
and each rank holds the columns [start, start + V/T) of z. Three b·s-sized reductions over
tp give everything (Megatron's vocab-parallel cross-entropy):
    m_n            all-reduce max of the local maxima        (N elements)
    Σ_v exp(..)    all-reduce sum of the local sums           (N elements) } one all-reduce
    z_n,t_n - m_n  all-reduce sum; only the owner adds it     (N elements) } of 2N elements
Backward needs no communication: dL/dz_nv = (softmax_nv - [v = t_n]) / N on the columns this
rank holds. The logits of one rank never leave it: no rank holds the full (N, V) logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.core.comm import Comm
from meshtrain.models.registry import logits_of, token_cross_entropy  # noqa: F401 (re-exported)

AXIS = "tp"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: the per-token loss from this rank's logit columns and three b·s-sized
    reductions over tp. Backward: (softmax - one-hot) on this rank's columns, no
    communication."""

    @staticmethod
    def forward(ctx, logits, targets, start, comm, tag):
        n_local = logits.size(-1)
        row_max = logits.max(dim=-1).values                               # (N,)
        comm.all_reduce(row_max, AXIS, op="max", tag=f"{tag}:forward")
        exp = (logits - row_max.unsqueeze(-1)).exp_()                     # (N, V/T)
        owned = (targets >= start) & (targets < start + n_local)          # (N,)
        local_target = (targets - start).masked_fill(~owned, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = (target_logit - row_max).masked_fill(~owned, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])               # (2, N)
        comm.all_reduce(sums, AXIS, tag=f"{tag}:forward")
        sum_exp, target_shifted = sums
        exp.div_(sum_exp.unsqueeze(-1))                                   # softmax, in place
        ctx.save_for_backward(exp, local_target, owned)
        return sum_exp.log() - target_shifted                             # (N,)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, owned = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.size(0), device=grad_logits.device)
        grad_logits[rows, local_target] -= owned.to(grad_logits.dtype)
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                                 comm: Comm, tag: str = "loss") -> torch.Tensor:
    """Per-token cross-entropy: `logits` (..., V/T) this rank's vocabulary columns from
    `start`, `targets` (...) global token ids; returns (...) losses, equal on every tp rank."""
    flat = logits.reshape(-1, logits.size(-1))                            # (N, V/T)
    loss = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), start, comm, tag)
    return loss.view(targets.shape)


class VocabParallelLoss:
    """The mean token cross-entropy of a vocab-parallel output layer, computed in parallel
    (what `token_cross_entropy` and the GPT's `loss` compute in one process)."""

    def __init__(self, start: int, comm: Comm) -> None:
        self.start, self.comm = start, comm

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_of(output), targets, self.start,
                                            self.comm).mean()

    def __repr__(self) -> str:
        return f"VocabParallelLoss(vocabulary from {self.start})"
