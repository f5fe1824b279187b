"""FLOPs of a training step, counted from the model spec (the time model's compute and the
numerator of MFU).

Source: Megatron 2021 (Narayanan et al., SC'21) §5.1; Korthikanti et al. 2022 §5 for what
recomputation re-runs; PaLM (Chowdhery et al. 2022) Appendix B for model FLOPs.
"""
from __future__ import annotations

from meshtrain.planner.model_spec import ModelSpec


def forward_flops_per_token(spec: ModelSpec, seq: int) -> tuple[float, float, float]:
    """(per layer, of which attention scores, logits) forward FLOPs for one token.

    Each weight is one multiply-add (2 FLOPs) per token; attention's QK^T and (attn)V add
    2 * 2 * s * h per token (Megatron 2021 §5.1: 24 B s h^2 + 4 B s^2 h per layer forward),
    s the keys a query counts (fewer under a sliding window: ModelSpec.keys_per_query);
    the logit layer 2 h V."""
    attn_scores = 4 * spec.keys_per_query(seq) * spec.hidden
    layer = 2 * spec.layer_matmul_params + attn_scores
    logits = 2 * spec.hidden * spec.vocab
    return layer, attn_scores, logits


def step_flops(spec: ModelSpec, global_batch: int, recompute: str = "none") -> float:
    """FLOPs of one training step over the whole cluster.

    Backward costs twice forward (Megatron 2021 §5.1), so a step is 3x forward; full
    recomputation re-runs every layer's forward (4x for the layers, the logit layer not
    recomputed); "attention" re-runs only the attention scores (Korthikanti 2022 §5); per-op
    "selective" re-runs no matmul (its elementwise work again is not counted as FLOPs).
    For a GPT with full recomputation this is Megatron 2021's
        F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    Its "72 ..." form without recomputation keeps V/(16lh), which undercounts the logit layer
    (3 x 2BshV = 6BshV, i.e. V/(12lh) in that form); this function counts it as 6BshV.
    """
    layer, scores, logits = forward_flops_per_token(spec, spec.seq)
    per_token = 3 * (spec.layers * layer + logits)
    if recompute == "full":
        per_token += spec.layers * layer
    elif recompute == "attention":
        per_token += spec.layers * scores
    return global_batch * spec.seq * per_token


def model_flops(spec: ModelSpec, global_batch: int) -> float:
    """Useful FLOPs per step (no recomputation): the numerator of MFU (PaLM, Chowdhery et al.
    2022, Appendix B)."""
    return step_flops(spec, global_batch, "none")


# What a step moves through memory outside its GEMMs and attention kernels, in bf16 (the
# layer norms, GELU, residual adds and bias gradients; the loss's upcast, log-softmax and
# their backward), from the kernels of meshtrain's bf16 step of GPT-2 124M (batch 8 x 1024)
# profiled on an H200 (docs/gpu.md): 4.4 ms per step in the blocks' elementwise kernels
# and 5.0 ms in the loss's, as bytes at that GPU's measured copy bandwidth (3.68 TB/s).
ELEMENTWISE_BYTES = 215   # per token, block and hidden channel, forward and backward
LOSS_BYTES = 45           # per token and vocabulary entry


def elementwise_bytes_per_token(spec: ModelSpec, layers: float, tp: int = 1,
                                elem_bytes: int = 2, loss: bool = True) -> float:
    """Bytes the elementwise work of one token's forward and backward moves over `layers`
    blocks and, where `loss` (the last stage), the loss (ELEMENTWISE_BYTES, LOSS_BYTES),
    split over `tp` ranks (the blocks' channels and the vocabulary split with their GEMMs);
    a model traced in `elem_bytes` precision moves what its trace found against a GPT's
    (ModelSpec.elementwise_scale)."""
    gpt = (layers * ELEMENTWISE_BYTES * spec.hidden + loss * LOSS_BYTES * spec.vocab) / tp
    return gpt * spec.elementwise_scale(elem_bytes)
