"""The lean cross-entropy (models/lean_cross_entropy.py) against torch's cross_entropy on the
fp32 logits: the same loss and gradients, over several chunks of rows, in fp32 and bf16."""
import pytest
import torch
import torch.nn.functional as F

from meshtrain.core import loss_chunks
from meshtrain.models.lean_cross_entropy import lean_cross_entropy

VOCAB = 100


@pytest.fixture
def seven_rows_a_chunk(monkeypatch):
    monkeypatch.setattr(loss_chunks, "CHUNK_BYTES", 4 * VOCAB * 7)   # 30 rows: 5 chunks
    assert loss_chunks.chunk_rows(VOCAB) == 7


def torch_and_lean(dtype, scale):
    torch.manual_seed(0)
    weight = torch.randn(16, VOCAB, dtype=dtype, requires_grad=True)
    hidden = torch.randn(3, 10, 16, dtype=dtype)
    targets = torch.randint(0, VOCAB, (3, 10))
    out = []
    for loss_of in (lambda z: F.cross_entropy(z.float().reshape(-1, VOCAB), targets.reshape(-1)),
                    lambda z: lean_cross_entropy(z, targets)):
        weight.grad = None
        loss = loss_of(hidden @ weight)
        (loss * scale).backward()
        out.append((loss.detach(), weight.grad.clone()))
    return out


@pytest.mark.parametrize("scale", [1.0, 0.25])   # a micro-batch's share scales the gradient
def test_fp32_loss_and_gradients_are_torchs(seven_rows_a_chunk, scale):
    (loss, grad), (lean_loss, lean_grad) = torch_and_lean(torch.float32, scale)
    torch.testing.assert_close(lean_loss, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(lean_grad, grad, rtol=0, atol=1e-7)


def test_bf16_logits_give_an_fp32_loss_and_torchs_bf16_gradients(seven_rows_a_chunk):
    (loss, grad), (lean_loss, lean_grad) = torch_and_lean(torch.bfloat16, 1.0)
    assert lean_loss.dtype == torch.float32
    torch.testing.assert_close(lean_loss, loss, rtol=0, atol=1e-5)   # the sum's order
    assert lean_grad.dtype == torch.bfloat16
    torch.testing.assert_close(lean_grad.float(), grad.float(), rtol=0.01, atol=1e-4)


def test_without_gradients_the_logits_are_left_as_they_are(seven_rows_a_chunk):
    logits = torch.randn(30, VOCAB)
    before = logits.clone()
    with torch.no_grad():
        loss = lean_cross_entropy(logits, torch.randint(0, VOCAB, (30,)))
    assert torch.equal(logits, before) and loss.dim() == 0
