"""Tokens/s and MFU in the benches' tables: the arithmetic, once (bench/device.py), and a
table that shows it (the benches themselves run launched ranks: `meshtrain bench ...`)."""
import pytest
import torch

from meshtrain.bench import ddp, device, hybrid
from meshtrain.core.flops import Peak
from meshtrain.models.gpt import GPT, gpt_config

BASIS = {"flops_per_token": 1e5, "peak_flops": 1e9, "peak_source": "measured: test"}


def test_tokens_per_second_and_mfu_over_every_device():
    got = device.throughput(step_s=0.5, tokens_per_step=1024, basis=BASIS, devices=2)
    assert got["tokens_per_s"] == 2048
    assert got["mfu"] == pytest.approx(2048 * 1e5 / (2 * 1e9))   # 10.24%


def test_the_basis_is_the_gpt_presets_6n_plus_12ldt(monkeypatch):
    monkeypatch.setattr(device, "run_peak", lambda d, p: Peak(3e9, f"measured: {d.type} {p}"))
    cfg = gpt_config("tiny", n_layer=3)
    n = sum(p.numel() for p in GPT(cfg).parameters())
    basis = device.flops_basis("tiny", torch.device("cpu"), n_layer=3)
    assert basis == {"flops_per_token": 6 * n + 12 * 3 * cfg.d_model * cfg.seq_len,
                     "peak_flops": 3e9, "peak_source": "measured: cpu fp32"}


def test_the_batch_is_the_same_tokens_on_the_device_asked_for():
    x, y = device.gpt_batch("tiny", 3, torch.device("cpu"))
    assert x.shape == (3, gpt_config("tiny").seq_len) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(device.gpt_batch("tiny", 3, torch.device("cpu"))[0], x)


def test_the_tables_show_tokens_per_second_and_mfu():
    seq = gpt_config("small").seq_len
    ours, theirs = device.throughput(0.25, 16 * seq, BASIS, 2), device.throughput(0.5, 16 * seq,
                                                                                   BASIS, 2)
    result = {"model": "small", "global_batch": 16, "steps": 1, "reps": 1, "basis": BASIS,
              "one_process": {"1_threads": 1.0},
              "worlds": {2: {"meshtrain_s": 0.25, "torch_s": 0.5, "ratio": 0.5,
                             "meshtrain_scaling": 4.0, "torch_scaling": 2.0,
                             "max_param_diff": 0.0, "meshtrain": ours, "torch": theirs}}}
    text = ddp.format_report(result)
    row = next(line for line in text.splitlines() if line.startswith("    2 "))
    assert f"{16 * seq / 0.25:,.0f}" in row and f"{16 * seq / 0.5:,.0f}" in row
    assert f"{ours['mfu']:.2%}" in row and f"{theirs['mfu']:.2%}" in row
    assert "1e+05 FLOPs/token (6N + 12LdT)" in text and "measured: test" in text

    rows = {"dp8 pp1 tp1": {"step_s": 0.25, "state_max": 2**20, "state_min": 2**20, **ours}}
    text = hybrid.format_report({"model": "small", "global_batch": 16, "steps": 1, "reps": 1,
                                 "rows": rows, "basis": BASIS})
    assert f"{ours['tokens_per_s']:,.0f}" in text and f"{ours['mfu']:.2%}" in text
