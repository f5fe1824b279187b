"""A transformers config recording "dtype": "bfloat16" (as every bf16 checkpoint's does)
builds fp32 weights: the Plan's precision decides the compute, and an fp32 plan no longer
trains pure-bf16 weights, whose small updates round away."""
import torch


def test_a_bf16_config_builds_fp32_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtrain.models.pretrained import from_pretrained
    from meshtrain.models.registry import build_model

    config = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    assert '"dtype": "bfloat16"' in (tmp_path / "config.json").read_text()
    for on_meta in (False, True):
        built = build_model(str(tmp_path / "config.json"), {}, 16, on_meta=on_meta)
        assert {p.dtype for p in built.module.parameters()} == {torch.float32}
    assert {p.dtype for p in from_pretrained(tmp_path).parameters()} == {torch.float32}
