import math

import pytest
import torch
from torch import nn

from meshtrain.models.gpt import GPT, PRESETS, GPTConfig, gpt_config


def _tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", **overrides))


def _tokens(B=2, T=16, V=256, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_module(name, bias):
    config = gpt_config(name, bias=bias)
    torch.manual_seed(0)
    assert config.num_params() == sum(p.numel() for p in GPT(config).parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_module_on_meta_device(name):
    with torch.device("meta"):                  # shapes only: no memory, no time
        model = GPT(PRESETS[name])
    assert PRESETS[name].num_params() == model.num_params()


def test_gpt2_124m_count_matches_published_value():
    # nanoGPT's GPT-2 124M with tied lm_head: 124,439,808; ours is untied (+ 50304 * 768),
    # pads the vocabulary to 50304 (+ 47 * 768 embedding rows) and has no key bias
    # (- 12 layers * 768).
    assert PRESETS["gpt2-124m"].vocab_size == 50304
    assert PRESETS["gpt2-124m"].num_params() == (124_439_808 + 50304 * 768 + 47 * 768
                                                 - 12 * 768)


def test_config_errors_name_value_and_fix():
    with pytest.raises(ValueError, match=r"d_model=130 is not divisible by n_head=4.*d_model=128"):
        GPTConfig(d_model=130)
    with pytest.raises(ValueError, match=r"n_layer=0: must be a whole number >= 1"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match=r"unknown GPT preset 'gpt5'.*tiny, small, gpt2-124m"):
        gpt_config("gpt5")
    assert gpt_config("small", n_layer=2).n_layer == 2


def test_same_seed_same_params_and_init_stds():
    a, b = _tiny(seed=3), _tiny(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = _tiny(seed=4)
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)
    big = GPT(GPTConfig(d_model=256, n_layer=8))
    assert big.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.count_nonzero(big.blocks[0].attn.q.bias) == 0


def test_sequential_layers_equal_forward_exactly():
    model = _tiny()
    idx = _tokens()
    layers = model.layers()
    assert len(layers) == model.config.n_layer + 2
    assert torch.equal(nn.Sequential(*layers)(idx), model(idx))


def test_initial_loss_is_near_uniform():
    model = _tiny()
    idx = _tokens(B=4, T=64)
    logits = model(idx)
    assert logits.shape == (4, 64, 256)
    loss = model.loss(logits, _tokens(B=4, T=64, seed=2))
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    model = _tiny()
    idx = _tokens(B=1, T=12)
    changed = idx.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_too_long_input_rejected():
    with pytest.raises(ValueError, match=r"sequence length 129 exceeds the model's seq_len=128"):
        _tiny()(_tokens(B=1, T=129))


def _sliced(linear: nn.Linear, rows=None, cols=None, keep_bias=True) -> nn.Linear:
    w = linear.weight[rows if rows is not None else slice(None)]
    w = w[:, cols] if cols is not None else w
    keep_bias = keep_bias and linear.bias is not None
    out = nn.Linear(w.shape[1], w.shape[0], bias=keep_bias)
    with torch.no_grad():
        out.weight.copy_(w)
        if keep_bias:
            out.bias.copy_(linear.bias[rows] if rows is not None else linear.bias)
    return out


def test_head_count_is_read_at_run_time():
    # Shard q/k/v by output rows and proj by input columns, as tensor parallel will: each half
    # attends over 2 of the 4 heads, and the two partial outputs sum to the full attention.
    attn = _tiny().blocks[0].attn
    x = torch.randn(2, 10, 128, generator=torch.Generator().manual_seed(5))
    halves = []
    for r, part in enumerate((slice(0, 64), slice(64, 128))):
        shard = type(attn).__new__(type(attn))
        nn.Module.__init__(shard)
        shard.n_head, shard.head_dim = attn.n_head, attn.head_dim
        shard.q, shard.k, shard.v = (_sliced(m, rows=part) for m in (attn.q, attn.k, attn.v))
        shard.proj = _sliced(attn.proj, cols=part, keep_bias=(r == 0))
        shard.core = attn.core
        assert shard.local_heads == 2 and "heads=2/4" in repr(shard)
        halves.append(shard(x))
    assert halves[0].shape == (2, 10, 128)
    torch.testing.assert_close(halves[0] + halves[1], attn(x), rtol=1e-5, atol=1e-6)
