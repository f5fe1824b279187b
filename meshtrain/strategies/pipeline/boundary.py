"""What crosses a stage boundary: one tensor, or a tuple of tensors (a mixture of experts
carries its routing sums beside the hidden state: models/moe_stages.py).

Forward sends each tensor of a stage's output; backward sends the gradient of each tensor
of the next stage's input, shaped as that tensor (zeros where it took no part in the loss),
so a small tensor riding beside the hidden state gets its gradient back as the hidden
state does. The receiver learns the shapes once per boundary from a fixed-size header
(see runtime.py's [Note: activation shapes]): a row per tensor, dtype and sizes.
"""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32)
ROW = 8          # dtype + 1 (0: no tensor), ndim, up to 6 sizes
MAX_TENSORS = 4  # the most tensors one boundary carries
Shapes = tuple[tuple[torch.Size, torch.dtype], ...]


def tensors(value) -> tuple[torch.Tensor, ...]:
    """The tensors of a boundary value (a tensor, or a tuple of them)."""
    return tuple(value) if isinstance(value, tuple) else (value,)


def rebuild(parts, like_tuple: bool):
    """Parts back in the value's form: a tuple where the value was one."""
    parts = tuple(parts)
    return parts if like_tuple else parts[0]


def problem(value, stage: int) -> str | None:
    """Why a stage's output (before the last) cannot cross a boundary, None where it can:
    it must be a tensor, or a tuple of 2 to MAX_TENSORS tensors, of DTYPES and 6 dims at most."""
    ok = isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and 2 <= len(value) <= MAX_TENSORS
        and all(isinstance(t, torch.Tensor) for t in value))
    if not ok:
        return (f"stage {stage} returns a {type(value).__name__}: a stage boundary carries a "
                f"tensor or a tuple of 2 to {MAX_TENSORS} tensors")
    for t in tensors(value):
        if t.dim() > ROW - 2 or t.dtype not in DTYPES:
            return (f"stage {stage} outputs a {t.dim()}-dim {t.dtype} tensor; a stage "
                    f"boundary carries at most {ROW - 2} dims of "
                    f"{', '.join(map(str, DTYPES))}")
    return None


def detached(value):
    return rebuild((t.detach() for t in tensors(value)), isinstance(value, tuple))


def mark_inputs(value) -> None:
    """A received activation: its floating tensors are where the input gradients collect."""
    for t in tensors(value):
        t.requires_grad_(t.is_floating_point() and torch.is_grad_enabled())


def input_gradients(value):
    """The gradient of each tensor of a stage's input, zeros where none reached it."""
    return rebuild((torch.zeros_like(t) if t.grad is None else t.grad for t in tensors(value)),
                   isinstance(value, tuple))


def backward(output, grad) -> None:
    """Backward from a stage's output (or the loss, `grad` None) given its gradient."""
    if grad is None:
        torch.autograd.backward(output)
        return
    pairs = [(t, g) for t, g in zip(tensors(output), tensors(grad)) if t.requires_grad]
    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def empty_like(value):
    return rebuild((torch.empty_like(t) for t in tensors(value)), isinstance(value, tuple))


def header(value, device: torch.device) -> torch.Tensor:
    """A value's shapes and dtypes as one fixed-size int64 tensor."""
    rows = torch.zeros(MAX_TENSORS, ROW, dtype=torch.int64)
    for i, t in enumerate(tensors(value)):
        rows[i, 0], rows[i, 1] = DTYPES.index(t.dtype) + 1, t.dim()
        rows[i, 2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return rows.reshape(-1).to(device)


def empty_header(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TENSORS * ROW, dtype=torch.int64, device=device)


def read_header(received: torch.Tensor) -> Shapes:
    rows = received.reshape(MAX_TENSORS, ROW).tolist()
    return tuple((torch.Size(r[2:2 + r[1]]), DTYPES[r[0] - 1]) for r in rows if r[0])


def shapes_of(value) -> Shapes:
    return tuple((t.shape, t.dtype) for t in tensors(value))


def empty(shapes: Shapes, device: torch.device):
    return rebuild((torch.empty(s, dtype=d, device=device) for s, d in shapes),
                   len(shapes) > 1)
