"""PowerSGD: DDP whose large gradients travel as rank-r factors (Vogels et al. 2019).

Each gradient of two or more dimensions, seen as an M x N matrix (its first dimension by the
rest), is sent as two thin factors: P = M Q (M x r) is all-reduced and orthonormalised, then
Q = M^T P (N x r) is all-reduced, and the gradient becomes P Q^T. (M + N) r numbers cross the
wire instead of M N. Both products are linear in M, so the sums of the ranks' factors are the
factors of the averaged gradient (the buckets hold each gradient pre-divided by the dp size).

- Error feedback: what the approximation missed of this rank's own gradient, M - P (M^T P)^T,
  is added to its next gradient (the residuals sum to what the averaged gradient missed).
- Warm start: each matrix's Q is kept from step to step (one power iteration per step then
  tracks the gradient's top subspace). The first Q comes from a generator seeded identically
  on every rank, on the gradient's device.
- A matrix whose compression rate M N / ((M + N) r) does not exceed `min_rate` (torch's
  `min_compression_rate`, 2 by default) gains too little: it travels uncompressed, with every
  1-D gradient and the step's statistics (the loss and the used flags, as DDP's last bucket
  carries them), in the same all-reduce as the P factors: two all-reduces a step, P with the
  rest, then Q (torch's hook sends the uncompressed ones apart: three latencies on a slow
  link). A rank above min(M, N) means min(M, N): the factors are then exact and PowerSGD
  reproduces DDP to round-off.

- Warm-up: the first `warmup_steps` steps are plain DDP (buckets all-reduced during
  backward), as torch's `start_powerSGD_iter`: early gradients are the most sensitive to
  approximation. Compression starts at step `warmup_steps` with zero residuals.

Gradients still land in DDP's buckets during backward (one copy in memory), but nothing is
launched before `finish_gradient_sync`: P needs the whole gradient.

[Note: checkpoints]
Neither the residuals nor the warm-started Q are checkpointed: a resumed run starts them
afresh (zero residuals, seeded Q), which costs a few steps of approximation quality, not
correctness.

The torch equivalent is the DDP comm hook torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook; this module shares no code with it.
"""
from __future__ import annotations

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.low_rank import factor_rank
from meshtrain.strategies.data_parallel.ddp import DDP
from meshtrain.strategies.shared.buckets import Bucket

SEED = 0   # the first Q of every matrix: the same on every rank


class PowerSGD(DDP):
    """DDP (slots 3 and 4) with its gradient sync compressed to rank `rank` factors."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, bucket_mb: float, rank: int,
                 min_rate: float = 2.0, warmup_steps: int = 0, axis: str = "dp") -> None:
        super().__init__(named_params, buffers, comm, bucket_mb, precision="fp32", axis=axis,
                         copy_when_alone=True)
        self.warmup_steps, self.steps = warmup_steps, 0
        generator = None
        self.factors: dict[int, _Factors] = {}   # id(param) -> its compression state
        for p in self.params:
            rows, cols = _matrix_shape(p)
            r = factor_rank(rows, cols, rank, min_rate)
            if p.dim() >= 2 and r:
                if generator is None:
                    generator = torch.Generator(device=p.device).manual_seed(SEED)
                self.factors[id(p)] = _Factors(rows, cols, r, p, generator)
        self.plain = [p for p in self.params if id(p) not in self.factors]

    def _warming_up(self) -> bool:
        return self.steps < self.warmup_steps

    def _launch(self, bucket: Bucket):
        if self._warming_up():
            return super()._launch(bucket)
        return None   # nothing leaves before the step's end: see the module's docstring

    def resume_at(self, steps_done: int) -> None:
        self.steps = steps_done

    @torch.no_grad()
    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Compress and all-reduce every gradient (plain DDP during the warm-up); return
        the global mean loss."""
        if self._warming_up():   # counted after: the flush still launches DDP's last bucket
            loss = super().finish_gradient_sync(local_loss)
            self.steps += 1
            return loss
        self.steps += 1
        stats = torch.cat([local_loss.reshape(1).float(), self.grads.used_flags()])
        self.grads.flush()
        grads = {id(p): bucket.grad_view(i)
                 for p, (bucket, i) in ((p, self.grads.slot(p)) for p in self.params)}
        compressed = [(self.factors[id(p)], grads[id(p)].view(self.factors[id(p)].rows, -1))
                      for p in self.params if id(p) in self.factors]
        for f, m in compressed:
            m.add_(f.residual)            # error feedback
        # one all-reduce carries every P = M Q and, after them, what travels whole and the
        # step's statistics: a slow link's latency is paid twice a step (this, then Q), not
        # three times
        p_len = sum(f.rows * f.r for f, _ in compressed)
        flat = torch.cat([(m @ f.q).reshape(-1) for f, m in compressed]
                         + [grads[id(p)].reshape(-1) for p in self.plain] + [stats])
        self.comm.all_reduce(flat, self.axis, tag="powersgd_p" if compressed else "grad")
        if compressed:
            self._finish_factors(compressed, flat[:p_len])
        offset = p_len
        for p in self.plain:
            g = grads[id(p)]
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        loss, *users = flat[offset:].tolist()   # one host sync
        for p, used_by in zip(self.params, users):
            p.grad = grads[id(p)] if used_by else None
        return loss / self.comm.mesh.size(self.axis)

    def _finish_factors(self, compressed: list[tuple["_Factors", torch.Tensor]],
                        summed_p: torch.Tensor) -> None:
        """From the summed P factors: orthonormalise each, all-reduce every Q = M^T P in
        one call, keep this rank's residual and leave P Q^T in each gradient."""
        qs, orth, offset = [], [], 0
        for f, m in compressed:
            p = summed_p[offset:offset + f.rows * f.r].view(f.rows, f.r)
            offset += f.rows * f.r
            orth.append(torch.linalg.qr(p).Q)   # identical on every rank: same summed P
            qs.append((m.t() @ orth[-1]).reshape(-1))
        local_q = torch.cat(qs)
        qflat = local_q.clone()
        self.comm.all_reduce(qflat, self.axis, tag="powersgd_q")
        offset = 0
        for (f, m), p in zip(compressed, orth):
            span = slice(offset, offset + f.cols * f.r)
            offset += f.cols * f.r
            f.q.copy_(qflat[span].view(f.cols, f.r))
            # error feedback: what this rank's own gradient lost, P (M^T P)^T short of M
            torch.addmm(m, p, local_q[span].view(f.cols, f.r).t(), alpha=-1.0,
                        out=f.residual)
            torch.mm(p, f.q.t(), out=m)  # the gradient: P Q^T of the summed factors

    def memory(self) -> dict[str, int]:
        out = super().memory()
        out["gradients"] += sum(f.nbytes for f in self.factors.values())
        return out


def _matrix_shape(p: nn.Parameter) -> tuple[int, int]:
    """A gradient as a matrix: its first dimension by all the others."""
    rows = p.shape[0] if p.dim() else 1
    return rows, p.numel() // max(rows, 1)


class _Factors:
    """One matrix's PowerSGD state: its warm-started Q and this rank's error residual."""

    def __init__(self, rows: int, cols: int, r: int, p: nn.Parameter,
                 generator: torch.Generator) -> None:
        self.rows, self.cols, self.r = rows, cols, r
        self.q = torch.randn(cols, r, generator=generator, device=p.device, dtype=p.dtype)
        self.residual = torch.zeros(rows, cols, device=p.device, dtype=p.dtype)

    @property
    def nbytes(self) -> int:
        return (self.q.numel() + self.residual.numel()) * self.q.element_size()
