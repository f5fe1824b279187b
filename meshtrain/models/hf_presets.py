"""Tiny transformers causal LMs built offline from transformers' config classes (no
download), for `meshtrain train --model llama-tiny` and the tests: 2 decoder layers, 4
attention heads, 2 key/value heads (grouped-query attention) where the family has them, a
byte vocabulary (256), no dropout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # this module is read before torch is imported (names_transformers)
    from torch import nn

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _config(name: str):
    import transformers as tf

    if name == "llama-tiny":
        return tf.LlamaConfig(**SIZES, tie_word_embeddings=False)
    if name == "llama-tiny-tied":
        return tf.LlamaConfig(**SIZES, tie_word_embeddings=True)
    if name == "qwen2-tiny":
        return tf.Qwen2Config(**SIZES, tie_word_embeddings=False)
    if name == "mistral-tiny":
        return tf.MistralConfig(**SIZES, tie_word_embeddings=False, sliding_window=None)
    if name == "mistral-window-tiny":   # every layer's window 6 keys, narrower than 16 tokens
        return tf.MistralConfig(**SIZES, tie_word_embeddings=False, sliding_window=6)
    if name == "hf-gpt2-tiny":
        return tf.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0)
    if name in FAMILIES:
        return _family_config(tf, name)
    if name in MOE:
        return _moe_config(tf, name)
    raise KeyError(name)


def _family_config(tf, name: str):
    """The decoder families beyond Llama's and GPT-2's, each with what sets it apart:
    per-head q/k norms (qwen3), whole-width q/k norms over gathered projections (olmo2),
    fused q/k/v and gate/up projections (phi3), soft-capped logits, tied and scaled
    embeddings, a padding row and sliding-window layers (gemma2), a parallel residual with a
    fused per-head q/k/v (gpt-neox), no tp plan of its own and a parallel residual (stablelm).
    """
    heads = dict(head_dim=16)
    common = dict(SIZES, pad_token_id=None, bos_token_id=0, eos_token_id=0)
    if name == "qwen3-tiny":
        return tf.Qwen3Config(**common, **heads, tie_word_embeddings=False)
    if name == "olmo2-tiny":
        return tf.Olmo2Config(**common, tie_word_embeddings=False)
    if name == "phi3-tiny":
        return tf.Phi3Config(**common, tie_word_embeddings=False, resid_pdrop=0.0,
                             embd_pdrop=0.0, attention_dropout=0.0)
    if name == "gemma2-tiny":   # windows of 8 tokens in 16: the sliding layers differ
        return tf.Gemma2Config(**{**common, "pad_token_id": 0}, **heads, sliding_window=8,
                               final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                               query_pre_attn_scalar=16, tie_word_embeddings=True)
    if name == "gpt-neox-tiny":
        return tf.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                use_parallel_residual=True, rotary_pct=0.5,
                                hidden_dropout=0.0, attention_dropout=0.0,
                                tie_word_embeddings=False)
    return tf.StableLmConfig(**common, use_parallel_residual=True, qk_layernorm=False,
                             tie_word_embeddings=False, hidden_dropout=0.0,
                             attention_dropout=0.0)


def _moe_config(tf, name: str):
    """Mixtures of 4 experts, each token to 2, with the router's load-balancing loss on
    (output_router_logits, coefficient 0.02: models/moe.py): Mixtral's (softmax over the
    top-2), Qwen3-MoE's (the top-k renormalised, per-head q/k norms), OLMoE's (top-k not
    renormalised, whole-width q/k norms), Qwen2-MoE's (a shared expert beside the routed
    ones, its output gated by a sigmoid of its own)."""
    common = dict(SIZES, pad_token_id=None, bos_token_id=0, eos_token_id=0,
                  num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                  tie_word_embeddings=False)
    if name == "mixtral-tiny":
        return tf.MixtralConfig(**common, num_local_experts=4, sliding_window=None)
    if name == "qwen3-moe-tiny":
        return tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                 head_dim=16, norm_topk_prob=True)
    if name == "qwen2-moe-tiny":
        return tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False)
    return tf.OlmoeConfig(**common, num_experts=4)


MOE = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny", "qwen2-moe-tiny")
FAMILIES = ("qwen3-tiny", "olmo2-tiny", "phi3-tiny", "gemma2-tiny", "gpt-neox-tiny",
            "stablelm-tiny")
PRESETS = ("llama-tiny", "llama-tiny-tied", "qwen2-tiny", "mistral-tiny", "mistral-window-tiny",
           "hf-gpt2-tiny", *FAMILIES, *MOE)


def names_transformers(spec: str) -> bool:
    """Whether --model `spec` is one transformers builds (a preset here, or a config.json),
    as models.registry.kind_of tells it, without importing torch or transformers."""
    return spec in PRESETS or spec.endswith(".json")


def config_of(name: str):
    """The transformers config of preset `name` (needs transformers: the `hf` extra)."""
    return _config(name)


def build(name: str) -> nn.Module:
    """A randomly initialised causal LM of preset `name`, from torch's global RNG."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config_of(name))
