"""MFU arithmetic: FLOPs per token, the peak table, and MFU against hand computation."""
import pytest
import torch

from meshtrain.core.flops import (flops_per_token, measured_peak, mfu,
                                  model_flops_per_token, table_peak)
from meshtrain.models.gpt import GPT, GPTConfig


def test_gpt2_124m_hand_computation():
    # GPT-2 124M (N=124,439,808 with tied weights), L=12, d=768, T=1024:
    # 6N = 746,638,848; 12*12*768*1024 = 113,246,208; sum 859,885,056.
    assert flops_per_token(124_439_808, 12, 768, 1024) == 859_885_056
    # plain PyTorch on one H100 (bf16, eager): 169.8k tokens/s on 989 TFLOP/s -> 14.76% with this N;
    # 163.1k -> 14.18%.
    assert mfu(169.8e3, 859_885_056, 989e12) == pytest.approx(169.8e3 * 859_885_056 / 989e12)
    assert mfu(169.8e3, 859_885_056, 989e12) == pytest.approx(0.14763, abs=1e-5)
    assert mfu(2 * 169.8e3, 859_885_056, 989e12, n_devices=2) == pytest.approx(0.14763, abs=1e-5)


def test_model_flops_per_token_reads_gpt_config():
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert model_flops_per_token(model, 32) == 6 * n + 12 * 2 * 32 * 32
    # A generic module with unknown L, d counts 6N; given L, d it adds the attention term.
    lin = torch.nn.Linear(10, 20)
    assert model_flops_per_token(lin, 8) == 6 * 220
    assert model_flops_per_token(lin, 8, n_layer=3, d_model=10) == 6 * 220 + 12 * 3 * 10 * 8


def test_peak_table_and_measured_peak():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        p = table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)
        assert p.flops == 989e12 and p.source == "table: H100-80GB bf16"
        assert table_peak("NVIDIA A100-SXM4-80GB", torch.float32).flops == 19.5e12
        torch.backends.cuda.matmul.allow_tf32 = True
        assert table_peak("NVIDIA A100-SXM4-80GB", torch.float32).flops == 156e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert table_peak("NVIDIA H200", torch.bfloat16).flops == 989e12
    # another part's figures than the table's SXM one: measured, not the SXM's peak
    assert table_peak("NVIDIA H100 PCIe", torch.bfloat16) is None
    # no bf16 tensor cores on a V100: no table peak for it; fp16's is the sheet's
    assert table_peak("Tesla V100-SXM2-32GB", torch.bfloat16) is None
    assert table_peak("Tesla V100-SXM2-32GB", torch.float16).flops == 125e12
    assert table_peak("Some Unknown GPU", torch.bfloat16) is None
    m = measured_peak(torch.device("cpu"), torch.float32, n=64, reps=1)
    assert m.flops > 0 and m.source.startswith("measured: 64x64 fp32 matmul on cpu")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="n_layer"):
        flops_per_token(10, -1, 4, 4)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)
