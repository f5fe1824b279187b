"""The shapes of meshtrain's GPT presets and the GPT's exact parameter count: plain data and
arithmetic that both the model (models/gpt.py) and the pure planner (planner/model_spec.py) read,
so it lives below both."""
from __future__ import annotations


# meshtrain's GPT presets (`meshtrain.models.gpt.PRESETS` builds its GPTConfigs from these),
# shapes from the published models. GPT-2 (Radford et al. 2019, and the HF `gpt2` /
# `gpt2-medium` configs): vocab 50257, context 1024. "gpt2-1.3b" is GPT-3 XL (Brown et al. 2020,
# Table 2.1: 24 layers, d_model 2048, d_head 128, context 2048); the paper's "24 heads" does not
# divide 2048 by 128, so we take 16 heads of 128. Counts differ from the papers' because
# lm_head is untied and the key projection has no bias here, and the GPT-2 vocabulary is padded
# from 50257 to 50304, a multiple of 64, as nanoGPT pads it: on an H100, the output layer's three
# matmuls at 50257 ran on unaligned kernels and took 15.4 ms of a 45 ms step (GPT-2 124M, bf16,
# 8 x 1024 tokens; `python -m meshtrain.bench.profile_step`). E.g. gpt2-124m: 124,439,808 tied
# + 38,633,472 untied lm_head + 47 * 768 padded embedding rows - 12 * 768 key biases.
GPT2_VOCAB = 50304   # 50257 tokens, padded to a multiple of 64 (the extra rows are never targets)
# "gpt-moe-tiny" is tiny's shape with a mixture of 4 experts (each token to 2) in every block
# and no biases, as Mixtral has none (models/gpt_moe.py).
GPT_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "gpt-moe-tiny": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128,
                         bias=False, experts=4, top_k=2),
    "small": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256),
    "gpt2-124m": dict(vocab_size=GPT2_VOCAB, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": dict(vocab_size=GPT2_VOCAB, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-1.3b": dict(vocab_size=GPT2_VOCAB, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
}


def gpt_num_params(vocab_size: int, seq_len: int, n_layer: int, d_model: int,
                   mlp_ratio: int = 4, bias: bool = True, experts: int = 0) -> int:
    """Exact parameter count of meshtrain's GPT of this shape, without building it."""
    d, b, h = d_model, int(bias), mlp_ratio * d_model
    layer_norm = d * (1 + b)
    embed = (vocab_size + seq_len) * d
    attn = 4 * d * d + 3 * d * b                # q, k, v, proj (k has no bias)
    mlp = d * h + h * b + h * d + d * b         # fc, proj
    if experts:   # the router (d x E) and E SwiGLU experts (gate and up, down), no biases
        mlp = d * experts + experts * 3 * d * h
    block = 2 * layer_norm + attn + mlp
    head = layer_norm + d * vocab_size          # ln_f, lm_head (no bias)
    return embed + n_layer * block + head
