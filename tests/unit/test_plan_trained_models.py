"""`meshtrain plan --model` takes every model `meshtrain train --model` builds: a transformers
preset or config.json (its config's shape) and a callable (its modules read), built on the
meta device; the planner's own presets and meshtrain's GPTs as before."""
import json
import textwrap

import pytest

from meshtrain.measure.trained_model import model_of
from meshtrain.models import registry
from meshtrain.planner.model_spec import PRESETS, ModelSpecError


def _built_params(name: str) -> int:
    return sum(p.numel() for p in registry.build_model(name, {}).module.parameters())


def test_a_transformers_preset_plans_with_its_configs_shape():
    spec = model_of("llama-tiny", None)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab,
            spec.seq) == (2, 64, 4, 2, 128, 256, 128)
    assert (spec.mlp, spec.norm, spec.tied, spec.learned_pos) == ("swiglu", "rmsnorm", False,
                                                                  False)
    assert spec.num_params == _built_params("llama-tiny")   # counted on the meta device
    gpt2 = model_of("hf-gpt2-tiny", 64)
    assert (gpt2.mlp, gpt2.norm, gpt2.tied, gpt2.learned_pos, gpt2.bias, gpt2.seq) == (
        "gelu", "layernorm", True, True, True, 64)
    assert gpt2.num_params == _built_params("hf-gpt2-tiny")


def test_a_llama_7b_config_file_plans_as_the_published_llama_7b(tmp_path):
    """Touvron et al. 2023's 7B as a config.json: the planner's preset's shape and count."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    spec, published = model_of(str(path), None), PRESETS["llama-7b"]
    for field in ("layers", "hidden", "heads", "vocab", "seq", "ffn_hidden", "kv_dim",
                  "layer_matmul_params", "mlp", "norm", "tied", "learned_pos", "num_params",
                  "largest_layer_params"):
        assert getattr(spec, field) == getattr(published, field), field


def test_a_callable_plans_from_its_modules(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        def build():
            return nn.Sequential(nn.Embedding(300, 32), nn.Linear(32, 32), nn.Linear(32, 300))
    """))
    monkeypatch.chdir(tmp_path)
    spec = model_of("my_model:build", 16)
    assert spec.num_params == 300 * 32 + 32 * 32 + 32 + 32 * 300 + 300
    assert (spec.hidden, spec.vocab, spec.seq) == (32, 300, 16)


def test_a_model_neither_plans_nor_trains_is_refused_naming_both():
    with pytest.raises(ModelSpecError, match=r"unknown model preset 'nosuch'.*llama-70b.*"
                                             r"`meshtrain train --model` builds.*llama-tiny"):
        model_of("nosuch", None)


def test_a_forward_fake_tensors_cannot_run_is_said_in_one_line_not_a_traceback(capfd):
    spec = model_of("mixtral-tiny", 32)   # grouped_mm's meta kernel takes bf16 only
    err = capfd.readouterr().err
    assert spec.experts == 4 and spec.traced_layer_bytes == ()   # from its shapes alone
    assert "Traceback" not in err
    assert ("mixtral-tiny: its forward does not run on fake tensors (RuntimeError: "
            "Expected inputs of BF16 type") in err
    assert "its activations are priced from its shapes alone" in err


def test_a_long_context_model_trains_on_2048_tokens_unless_told(tmp_path):
    from meshtrain.cli.train_data import settle_data
    from meshtrain.train.config import RunConfig

    long = tmp_path / "long.json"   # Llama 3's context: 128k tokens a row, 32 rows a batch
    long.write_text(json.dumps(dict(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=131072)))
    for seq, trained in [(None, 2048), (4096, 4096)]:
        config = RunConfig(run_dir="r", model=str(long), seq_len=seq)
        settle_data(config)   # the command's, before any rank starts
        assert config.seq_len == trained
    # the planner (model_of) prices the whole context, as the model's build states it
    assert registry.build_model(str(long), {}, on_meta=True).seq_len == 131072
