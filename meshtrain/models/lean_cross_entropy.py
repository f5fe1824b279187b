"""Cross-entropy that keeps no fp32 copy of the logits: the loss recomputation plans use.

torch's `cross_entropy(logits.float(), y)` keeps the fp32 log-probabilities for backward
(4 s b V bytes, 1.6 GB for GPT-2 at 8 x 1024 tokens) and backward makes two more fp32
logits-shaped tensors beside them. Once every layer is recomputed, that is most of a step's
activation peak. The loss is the graph's last operation, so its gradient w.r.t. the logits,
(softmax - onehot) / N, is known in forward: computed there in fp32, a chunk of rows at a
time, and written over the logits' own buffer (nothing else reads them: the projection's
backward needs its input, not its output), it costs no memory beyond that buffer and a chunk.
Backward only scales it. The values are torch's in exact arithmetic (softmax's rounding
order differs), as the tests check.
"""
from __future__ import annotations

import torch

from meshtrain.core.loss_chunks import chunk_rows


class _LeanCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = logits.size(-1)
        flat = logits.detach().view(-1, vocab)   # the buffer the gradient is written into
        rows = targets.reshape(-1, 1)
        n = flat.size(0)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        keep_grad = ctx.needs_input_grad[0]
        step = chunk_rows(vocab)
        for start in range(0, n, step):
            part = flat[start:start + step]
            target = rows[start:start + part.size(0)]
            z = part.float() if part.dtype != torch.float32 else part.clone()
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            total += (lse - z.gather(1, target)).sum()
            if keep_grad:   # softmax - onehot, over the mean's N
                z.sub_(lse).exp_().scatter_add_(1, target, torch.full_like(z[:, :1], -1.0))
                part.copy_(z.div_(n))
        if keep_grad:
            ctx.save_for_backward(flat)
            ctx.shape = logits.shape
        return total / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss.to(grad.dtype)).view(ctx.shape), None


def lean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token, in fp32 whatever the logits' dtype, like
    `F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))`. With gradients
    enabled the logits' buffer is overwritten by their gradient: pass logits nothing else
    reads afterwards (a model's output, straight to its loss). Targets are token ids (no
    ignore index)."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return _LeanCrossEntropy.apply(logits, targets)
