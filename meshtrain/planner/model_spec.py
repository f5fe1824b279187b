"""What the planner needs to know about a model: its shape, parameter count and largest layer.

A ModelSpec comes from a preset, a raw description (layers, hidden, heads, vocab, seq), a
meshtrain `GPTConfig`, or an instantiated `nn.Module` (parameters counted, largest layer read).

Parameter count of a decoder block (Megatron 2021, Narayanan et al., §5.1 and Table 1):
attention 4h^2 + 4h, MLP 8h^2 + 5h, two LayerNorms 4h: 12h^2 + 13h per layer; with embeddings
(V + s)h the model holds P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)). The general form below
reduces to that for a GPT and also covers SwiGLU MLPs (3 matrices h x f), grouped-query
attention (k, v of width kv_heads * h/heads), RMSNorm (h weights) and untied output heads.
A mixture of experts' layer holds its E experts' matrices and a router (h x E), of which
one token multiplies by the router and its top-k experts (and any shared ones): its FLOPs
follow k x the expert width (`ffn_hidden`), its saved activations its k routed rows
(planner/experts.saved_bytes_per_token; under selective recomputation
selective_bytes_per_token), its weights all E.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from meshtrain.core.gpt_shapes import GPT_SHAPES, gpt_num_params


class ModelSpecError(ValueError):
    """A model description that cannot be used: the message names the field and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0                    # MLP width; 0 means 4 * hidden
    kv_heads: int = 0               # 0 means heads (multi-head attention)
    mlp: str = "gelu"               # "gelu" (2 matrices) | "swiglu" (3 matrices, no bias)
    bias: bool = True               # biases in Linear layers and LayerNorm
    norm: str = "layernorm"         # "layernorm" (weight [+ bias]) | "rmsnorm" (weight)
    tied: bool = True               # output head shares the token embedding
    learned_pos: bool = True        # learned position embedding (s x h) vs rotary (none)
    dropout: bool = True            # dropout masks stored (Korthikanti's 1-byte masks)
    flash_attention: bool = False   # fused attention that stores no s x s scores
    measured_params: int = 0        # exact count read from a module (overrides the formula)
    measured_largest: int = 0       # largest layer read from a module
    measured_gathered_once: int = 0  # ZeRO-3's units gathered once a micro-batch, read from
                                    # a module (0: a GPT's, `gathered_once_params`)
    # traced from the model itself on fake tensors (measure/traced.py), where it was: per
    # precision, (element bytes, bytes per token saved for backward) by one layer and by
    # the final norm and output layer, and (element bytes, its elementwise work against a
    # GPT's of its shape), and what one layer keeps per token under per-op selective
    traced_layer_bytes: tuple[tuple[int, float], ...] = ()
    traced_head_bytes: tuple[tuple[int, float], ...] = ()
    traced_elementwise: tuple[tuple[int, float], ...] = ()
    traced_selective_bytes: tuple[tuple[int, float], ...] = ()
    # a mixture of experts in every layer's MLP (0 experts: dense; planner/experts.py)
    experts: int = 0                # routed experts per layer
    top_k: int = 0                  # experts each token is routed to
    expert_ffn: int = 0             # one expert's MLP width (0: ffn)
    shared_ffn: int = 0             # the always-on shared experts' MLP width, all together
    # sliding-window attention (Mistral, Gemma-2/3's local layers): a query sees `window` keys
    window: int = 0                 # keys a sliding layer's query sees (0: no window)
    windowed_layers: int = 0        # how many layers slide (0 with a window: every layer)
    # one context-parallel rank's view of a sequence (context_parallel.rank_view): it holds
    # `seq` tokens of a longer sequence, which its queries attend and its table positions
    attention_span: int = 0         # keys each query attends (0: seq)
    positions: int = 0              # rows of a learned position table (0: seq)
    output_twice: bool = False      # all-to-all cp: attention's output kept in both layouts

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelSpecError(f"model {key}={v!r}: must be a whole number >= 1")
        if self.hidden % self.heads:
            raise ModelSpecError(f"model hidden={self.hidden} is not divisible by heads="
                                 f"{self.heads}; choose heads that divide hidden")
        if self.mlp not in ("gelu", "swiglu") or self.norm not in ("layernorm", "rmsnorm"):
            raise ModelSpecError(f"model mlp={self.mlp!r}/norm={self.norm!r}: mlp is 'gelu' or "
                                 f"'swiglu', norm is 'layernorm' or 'rmsnorm'")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ModelSpecError(f"model top_k={self.top_k} with {self.experts} experts: each "
                                 f"token goes to 1 to {self.experts} experts; set top_k so")

    # -- shape ------------------------------------------------------------------------------
    @property
    def ffn_hidden(self) -> int:
        """The MLP width one token passes through: a mixture's top-k experts and its shared
        ones side by side (what its FLOPs and saved activations scale with)."""
        if self.experts:
            return self.top_k * self.expert_width + self.shared_ffn
        return self.ffn or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn or 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def layer_expert_params(self) -> int:
        """One layer's routed experts' weights (what expert parallel splits)."""
        return self.experts * self.mlp_matrices * self.hidden * self.expert_width

    @property
    def span(self) -> int:
        return self.attention_span or self.seq

    def keys_per_query(self, span: int) -> float:
        """Keys a query's scores count over a sequence of `span` (the planner counts all
        `span` for a full-attention query), averaged over the layers: a sliding layer counts
        `span` x the share of the causal (query, key) pairs its window keeps,
        (w(w+1)/2 + (span-w) w) / (span(span+1)/2)."""
        w = self.window
        if not w or w >= span:
            return float(span)
        kept = (w * (w + 1) / 2 + (span - w) * w) / (span * (span + 1) / 2)
        sliding = (self.windowed_layers or self.layers) / self.layers
        return span * (1 - sliding * (1 - kept))

    @property
    def position_rows(self) -> int:
        return self.positions or self.seq

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    # -- parameters -------------------------------------------------------------------------
    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the matrices one token multiplies by in one block (FLOPs = 2x this)."""
        h, f = self.hidden, self.ffn_hidden
        attn = 2 * h * h + 2 * h * self.kv_dim                 # q, o and k, v
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f
        router = h * self.experts                              # a mixture's router (h x E)
        return attn + mlp + router

    @property
    def layer_params(self) -> int:
        h, f, b = self.hidden, self.ffn_hidden, int(self.bias)
        biases = b * (2 * h + 2 * self.kv_dim + (2 if self.mlp == "swiglu" else 1) * f + h)
        idle = (self.experts - self.top_k) * self.mlp_matrices * h * self.expert_width
        return self.layer_matmul_params + idle + biases + 2 * self.norm_params

    @property
    def layer_replicated_params(self) -> int:
        """What tensor parallel keeps whole on every rank of a block (Megatron): the two
        norms and the biases of the two row-parallel layers (added once, after the sum);
        a mixture's router and routed experts too (strategies/tensor_parallel/gpt.py)."""
        mixture = self.layer_expert_params + self.hidden * self.experts
        return 2 * self.norm_params + 2 * self.hidden * int(self.bias) + mixture

    @property
    def embedding_replicated_params(self) -> int:
        """A learned position embedding: tensor parallel splits only the token embedding."""
        return self.position_rows * self.hidden if self.learned_pos else 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.embedding_replicated_params

    @property
    def head_params(self) -> int:
        """Final norm plus, when untied, the output projection."""
        return self.norm_params + (0 if self.tied else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        if self.measured_params:
            return self.measured_params
        return self.embedding_params + self.layers * self.layer_params + self.head_params

    @property
    def largest_layer_params(self) -> int:
        """The biggest piece that strategies without tensor parallelism keep whole on one
        device: a block, the embedding, or the output head (pipeline's smallest stage and
        ZeRO-3's gathering unit)."""
        if self.measured_largest:
            return self.measured_largest
        return max(self.layer_params, self.embedding_params, self.head_params)

    @property
    def gathered_once_params(self) -> int:
        """What ZeRO-3 gathers once per micro-batch, not again for backward: its last unit
        (whose backward follows at once) and its root (parameters in no unit, held through
        backward): a GPT's output layer; a transformers model's last decoder layer and all
        outside its decoder layers (strategies/zero/zero3.py)."""
        return self.measured_gathered_once or self.head_params

    @property
    def largest_tensor_params(self) -> int:
        """The biggest single weight matrix: an MLP matrix (h x f), the token embedding or an
        untied output head (V x h), or a square attention matrix. Its gradient is the largest
        one autograd materialises at a time (see activations.transient_bytes)."""
        h = self.hidden
        if self.experts:   # transformers keeps each projection of all experts in one tensor
            fused = (self.mlp_matrices - 1) * self.experts * self.expert_width * h   # gate+up
            return max(fused, self.vocab * h, h * max(h, self.shared_ffn))
        return max(h * self.ffn_hidden, self.vocab * h, h * h)

    def traced_bytes_per_token(self, elem_bytes: int, head: bool = False,
                               selective: bool = False) -> float | None:
        """What one layer (or the final norm and output layer) saves per token in
        `elem_bytes` precision, as traced (`selective`: what a layer keeps under per-op
        selective recomputation); None where the model was not traced in it."""
        table = (self.traced_head_bytes if head else
                 self.traced_selective_bytes if selective else self.traced_layer_bytes)
        return dict(table).get(elem_bytes)

    def elementwise_scale(self, elem_bytes: int) -> float:
        """This model's elementwise work against a GPT's of its shape, as traced (1: not
        traced in that precision)."""
        return dict(self.traced_elementwise).get(elem_bytes, 1.0)

    def describe(self) -> str:
        moe = (f", {self.experts} experts (top {self.top_k}, {self.expert_width} wide)"
               if self.experts else "")
        return (f"{self.name}: {self.num_params / 1e9:.3g}B parameters, {self.layers} layers, "
                f"hidden {self.hidden}, {self.heads} heads, vocab {self.vocab}, seq {self.seq}"
                f"{moe}")


# Published shapes. GPT-2 (Radford et al. 2019; HF gpt2 / gpt2-medium configs), "gpt2-1.3b" as
# GPT-3 XL with 16 heads of 128 (Brown et al. 2020, Table 2.1), GPT-3 175B (ibid.), Llama
# (Touvron et al. 2023, Table 2: 7B 32 x 4096, 70B 80 x 8192 with 8 kv heads; SwiGLU widths
# 11008 / 28672 from the released configs; RMSNorm; untied head; rotary positions); Llama 3.1
# 8B from its released config (8 kv heads, SwiGLU 14336, vocabulary 128256), no dropout and
# a fused attention as torchtitan trains it (its Table 1 at 8192 tokens).
PRESETS: dict[str, ModelSpec] = {
    "gpt2-124m": ModelSpec("gpt2-124m", 12, 768, 12, 50257, 1024),
    "gpt2-350m": ModelSpec("gpt2-350m", 24, 1024, 16, 50257, 1024),
    "gpt2-1.3b": ModelSpec("gpt2-1.3b", 24, 2048, 16, 50257, 2048),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 50257, 2048),
    "llama-7b": ModelSpec("llama-7b", 32, 4096, 32, 32000, 4096, ffn=11008, mlp="swiglu",
                          bias=False, norm="rmsnorm", tied=False, learned_pos=False),
    "llama-70b": ModelSpec("llama-70b", 80, 8192, 64, 32000, 4096, ffn=28672, kv_heads=8,
                           mlp="swiglu", bias=False, norm="rmsnorm", tied=False,
                           learned_pos=False),
    "llama3.1-8b": ModelSpec("llama3.1-8b", 32, 4096, 32, 128256, 8192, ffn=14336, kv_heads=8,
                             mlp="swiglu", bias=False, norm="rmsnorm", tied=False,
                             learned_pos=False, dropout=False, flash_attention=True),
}


def preset(name: str, seq: int | None = None) -> ModelSpec:
    """A planner preset, or a meshtrain GPT preset (`GPT_SHAPES`) by name."""
    key = str(name).lower()
    if key in PRESETS:
        spec = PRESETS[key]
    else:
        if key not in GPT_SHAPES:
            known = list(PRESETS) + [k for k in GPT_SHAPES if k not in PRESETS]
            raise ModelSpecError(f"unknown model preset {name!r}; choose one of "
                                 f"{', '.join(known)}, or describe it with --layers --hidden "
                                 f"--heads --vocab --seq")
        # a sequence override resizes the GPT's learned position table (seq x d_model)
        shape = dict(GPT_SHAPES[key], seq_len=seq or GPT_SHAPES[key]["seq_len"])
        spec = replace(from_gpt_shape(**shape, name=key), measured_params=gpt_num_params(
            shape["vocab_size"], shape["seq_len"], shape["n_layer"], shape["d_model"],
            bias=shape.get("bias", True), experts=shape.get("experts", 0)))
    return replace(spec, seq=seq) if seq else spec


def from_description(layers: int, hidden: int, heads: int, vocab: int, seq: int,
                     name: str = "custom", **kw) -> ModelSpec:
    """A GPT-shaped model from its raw description (Megatron's Table 1 style)."""
    return ModelSpec(name, layers, hidden, heads, vocab, seq, **kw)


def from_gpt_shape(vocab_size: int, seq_len: int, n_layer: int, n_head: int, d_model: int,
                   mlp_ratio: int = 4, bias: bool = True, name: str = "gpt", experts: int = 0,
                   top_k: int = 2) -> ModelSpec:
    """meshtrain's reference GPT from its config's fields (GPTConfig's names and defaults):
    untied lm_head without bias, learned positions, GELU MLP, no dropout, and
    `scaled_dot_product_attention` (fused: no s x s scores kept). With experts, every MLP a
    mixture of SwiGLU experts mlp_ratio x d_model wide (models/gpt_moe.py)."""
    moe = dict(experts=experts, top_k=top_k, mlp="swiglu") if experts else {}
    return ModelSpec(name, n_layer, d_model, n_head, vocab_size, seq_len, ffn=mlp_ratio * d_model,
                     bias=bias, tied=False, dropout=False, flash_attention=True, **moe)


def from_gpt_config(config, name: str = "gpt") -> ModelSpec:
    """meshtrain's reference GPT from its GPTConfig (`from_gpt_shape`), with the exact
    parameter count the config gives."""
    spec = from_gpt_shape(config.vocab_size, config.seq_len, config.n_layer, config.n_head,
                          config.d_model, config.mlp_ratio, config.bias, name,
                          getattr(config, "experts", 0), getattr(config, "top_k", 2))
    if hasattr(config, "num_params"):  # the config knows its exact count; trust it
        spec = replace(spec, measured_params=config.num_params())
    return spec


def from_module(module, seq: int | None = None, name: str | None = None, **shape) -> ModelSpec:
    """Parameters and largest layer read from an instantiated `nn.Module`.

    The largest layer is the largest of `module.layers()` when the module exposes its
    pipeline-able layers (meshtrain's GPT does), else of its leaf modules. Shape fields the
    module does not reveal (layers, hidden, heads, vocab, seq) come from `module.config` when it
    is a GPTConfig, else from `shape` and simple reads (most common Linear input width).
    """
    import torch.nn as nn  # lazy: torch, only this entry point needs it

    total = sum(p.numel() for p in module.parameters())
    if hasattr(module, "layers") and callable(module.layers):
        units = list(module.layers())
    else:
        units = [m for m in module.modules() if not list(m.children())]
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=total)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "d_model"):
        spec = from_gpt_config(config, name or type(module).__name__)
    else:
        widths = [m.in_features for m in module.modules() if isinstance(m, nn.Linear)]
        embeds = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
        hidden = shape.pop("hidden", max(set(widths), key=widths.count) if widths else 1)
        spec = ModelSpec(name or type(module).__name__,
                         layers=shape.pop("layers", max(1, len(units))), hidden=hidden,
                         heads=shape.pop("heads", 1),
                         vocab=shape.pop("vocab", max(embeds) if embeds else hidden),
                         seq=seq or shape.pop("seq", 1), **shape)
    return replace(spec, seq=seq or spec.seq, measured_params=total, measured_largest=largest)


def from_transformers_config(config, seq: int | None = None, name: str | None = None,
                             params: int = 0, largest: int = 0) -> ModelSpec:
    """A transformers causal LM's shape from its config, read by attribute (the planner
    imports no transformers): GPT-2's field names (n_layer, n_embd, n_head, n_inner,
    n_positions) or the Llama family's (num_hidden_layers, hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size, max_position_embeddings). A SiLU MLP is SwiGLU
    (gate, up and down: Llama, Qwen2, Mistral), RMSNorm where the config has rms_norm_eps,
    positions rotary but GPT-2's (learned), attention fused (transformers' default, sdpa).
    A mixture of experts (Mixtral's num_local_experts, Qwen-MoE's and OLMoE's num_experts,
    DeepSeek's n_routed_experts; num_experts_per_tok; each expert moe_intermediate_size wide,
    else intermediate_size; shared experts as Qwen2-MoE's shared_expert_intermediate_size or
    DeepSeek's n_shared_experts of moe_intermediate_size) is read as one in every layer;
    a sliding window (sliding_window, on the layer_types that say sliding_attention) too.
    `seq`: the training sequence (default: the config's context); `params`, `largest`: the
    exact counts of the built model, where known."""
    def field(*names, default=None):
        return next((getattr(config, n) for n in names if getattr(config, n, None) is not None),
                    default)

    gpt2 = getattr(config, "model_type", None) == "gpt2"
    act = field("hidden_act", "activation_function", default="gelu")
    drop = field("attention_dropout", "attn_pdrop", default=0.0) or field("resid_pdrop",
                                                                          default=0.0)
    return ModelSpec(name or getattr(config, "model_type", "transformers"),
                     layers=field("num_hidden_layers", "n_layer"),
                     hidden=field("hidden_size", "n_embd"),
                     heads=field("num_attention_heads", "n_head"), vocab=config.vocab_size,
                     seq=seq or field("max_position_embeddings", "n_positions"),
                     ffn=field("intermediate_size", "n_inner", default=0),
                     kv_heads=field("num_key_value_heads", default=0),
                     mlp="swiglu" if act in ("silu", "swish") else "gelu",
                     bias=gpt2 or bool(field("attention_bias", "mlp_bias", default=False)),
                     norm="rmsnorm" if hasattr(config, "rms_norm_eps") else "layernorm",
                     tied=bool(field("tie_word_embeddings", default=True)), learned_pos=gpt2,
                     dropout=bool(drop), flash_attention=True, measured_params=params,
                     measured_largest=largest, **_moe_fields(config), **_window_fields(config))


def _window_fields(config) -> dict:
    """A config's sliding window and how many layers slide (its layer_types' sliding ones,
    else every layer); nothing without one (Qwen2 nulls it unless use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return {}
    sliding = sum(t == "sliding_attention" for t in types) if types else 0
    if types and not sliding:
        return {}
    return dict(window=window, windowed_layers=sliding)


def _moe_fields(config) -> dict:
    """A transformers MoE config's experts, top-k and widths (nothing for a dense one)."""
    experts = next((getattr(config, n) for n in ("num_local_experts", "num_experts",
                                                  "n_routed_experts")
                    if getattr(config, n, None)), 0)
    if not experts:
        return {}
    width = getattr(config, "moe_intermediate_size", None) or 0
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or (getattr(config, "n_shared_experts", None) or 0) * width)
    return dict(experts=experts, top_k=getattr(config, "num_experts_per_tok", None) or 1,
                expert_ffn=width, shared_ffn=shared)
