"""The reference GPT: a pre-norm decoder-only transformer that every strategy trains.

Built for the strategies without knowing about any of them:
- `GPT.layers()` is `[embed, *blocks, head]`; `nn.Sequential(*model.layers())` computes exactly
  `model.forward`, which is how pipeline parallel cuts the model into stages.
- No weight tying between the token embedding and `lm_head`, so the first and last pipeline
  stages own independent parameters and need no shared-weight gradient exchange.
- Attention reads its head count from its q projection at run time, so a tensor-parallel pass
  that swaps q/k/v for column-sharded Linears and proj for a row-sharded one gets head-parallel
  attention with no change here (see `CausalSelfAttention`).
- No dropout, and initialisation draws only from torch's global RNG: the same seed gives the
  same parameters and the same training numbers in every plan.
- `GPTConfig(experts=E, top_k=K)`: each block's MLP is a mixture of E SwiGLU experts, each
  token routed to K of them (models/gpt_moe.py), and the model returns its logits with every
  block's router logits (`MoEOutput`) for the load-balancing loss; experts=0 (the default)
  is the dense GPT, unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.core.gpt_shapes import GPT_SHAPES, gpt_num_params
from meshtrain.models.gpt_moe import MoEFeedForward, MoEOutput


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Token vocabulary; 256 for byte-level text."""
    seq_len: int = 128
    """Longest context the position embedding covers."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; d_model must divide evenly among them."""
    d_model: int = 128
    """Width of the residual stream."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers (lm_head, the router and experts never have one)."""
    experts: int = 0
    """Experts of each block's mixture-of-experts MLP; 0: the dense MLP."""
    top_k: int = 2
    """Experts each token is routed to (with experts > 0), Mixtral's 2 by default."""
    router_aux_coef: float = 0.02
    """Weight of the router's load-balancing loss in the training loss (Mixtral presets' 0.02
    here; 0: none added)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "bias":
                if not isinstance(value, bool):
                    raise ValueError(f"GPTConfig.bias={value!r}: must be True or False")
            elif f.name == "router_aux_coef":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"GPTConfig.router_aux_coef={value!r}: must be a number "
                                     ">= 0")
            else:
                least = 0 if f.name == "experts" else 1
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ValueError(f"GPTConfig.{f.name}={value!r}: must be a whole number "
                                     f">= {least}")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} routes each token to more experts "
                             f"than the {self.experts} each block has; choose top_k <= "
                             f"{self.experts} (--top-k) or more experts (--experts)")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                f"choose d_model a multiple of n_head (e.g. d_model="
                f"{self.d_model // self.n_head * self.n_head or self.n_head}) or another n_head")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)`, without building it (the planner's count)."""
        return gpt_num_params(self.vocab_size, self.seq_len, self.n_layer, self.d_model,
                              self.mlp_ratio, self.bias, self.experts)


# The presets' shapes live with the planner, which sizes them without torch (model_spec.py)
PRESETS: dict[str, GPTConfig] = {name: GPTConfig(**shape) for name, shape in GPT_SHAPES.items()}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """The preset `name`, with any GPTConfig field overridden (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; known presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Embedding(nn.Module):
    """Token plus learned position embedding: idx (B, T) int64 -> (B, T, d)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(-1)
        if T > self.pos.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len="
                             f"{self.pos.num_embeddings}; crop the input or build the model "
                             f"with a larger GPTConfig.seq_len")
        pos = torch.arange(T, device=idx.device)
        return self.tok(idx) + self.pos(pos)       # (B, T, d) + (T, d)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hs)) v, causal: the part of attention without parameters, kept as
    a module of its own so that selective recomputation can wrap exactly it.
    q, k, v (B, nh, T, hs) -> (B, nh, T, hs)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections.

    The number of heads this module computes is `q.out_features // head_dim`, read at run time.
    With q, k, v column-sharded over tp ranks (out_features d/tp) and proj row-sharded
    (in_features d/tp), each rank attends over its own n_head/tp heads and returns a partial
    sum of the output projection; the tensor-parallel wrapper all-reduces it.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head                # of the whole model, for printing
        self.head_dim = config.head_dim
        self.q = nn.Linear(d, d, bias=config.bias)
        # No key bias, ever: it adds q.b to every score of a query, which softmax cancels, so
        # its true gradient is 0 and Adam would turn the round-off there into lr-sized steps
        # that differ between any two ways of computing the same batch.
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=config.bias)
        self.proj = nn.Linear(d, d, bias=config.bias)
        self.core = AttentionCore()

    @property
    def local_heads(self) -> int:
        return self.q.out_features // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        nh, hs = self.local_heads, self.head_dim
        q = self.q(x).view(B, T, nh, hs).transpose(1, 2)   # (B, nh, T, hs)
        k = self.k(x).view(B, T, nh, hs).transpose(1, 2)   # (B, nh, T, hs)
        v = self.v(x).view(B, T, nh, hs).transpose(1, 2)   # (B, nh, T, hs)
        y = self.core(q, k, v)                             # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)       # (B, T, nh*hs)
        return self.proj(y)                                # (B, T, d)

    def extra_repr(self) -> str:
        return f"heads={self.local_heads}/{self.n_head}, head_dim={self.head_dim}"


class MLP(nn.Module):
    """proj(gelu(fc(x))): (B, T, d) -> (B, T, d); fc column- and proj row-shardable."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln1(x)), then + mlp(ln2(x)); (B, T, d) -> (B, T, d)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = (MoEFeedForward(config.d_model, config.mlp_ratio * config.d_model,
                                   config.experts, config.top_k)
                    if config.experts else MLP(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the (untied, bias-free) vocabulary projection: (B, T, d) -> (B, T, V)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """Decoder-only transformer: embed -> blocks -> head, idx (B, T) -> logits (B, T, V).

    Initialisation (GPT-2): Linear and Embedding weights ~ N(0, 0.02), biases zero, LayerNorm
    ones/zeros; the residual projections attn.proj and mlp.proj use std 0.02/sqrt(2*n_layer) so
    the residual stream's variance does not grow with depth. Weights are not tied. With
    experts, the router as a Linear and each expert as the MLP: gate_up_proj ~ N(0, 0.02),
    down_proj (a residual projection) the residual std.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():   # fixed order: same seed, same parameters
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif name.endswith("mlp.experts"):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
                nn.init.normal_(module.down_proj, mean=0.0, std=residual_std)

    def layers(self) -> list[nn.Module]:
        """[embed, *blocks, head]: run in order, they compute exactly `forward` (with
        experts, its logits without the router's: pipeline stages carry those beside the
        hidden state, models/moe_stages.routed_gpt_layers)."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor | MoEOutput:
        x = self.embed(idx)                        # (B, T, d)
        for block in self.blocks:
            x = block(x)                           # (B, T, d)
        logits = self.head(x)                      # (B, T, V)
        if not self.config.experts:
            return logits
        return MoEOutput(logits, tuple(b.mlp.take_router_logits() for b in self.blocks))

    def loss(self, output: torch.Tensor | MoEOutput, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all B*T tokens: logits (B, T, V) (or an MoEOutput's),
        targets (B, T) int64. The router's loss is added by models/moe.RouterLoss."""
        logits = getattr(output, "logits", output)   # an MoEOutput's, a pipeline's Routed
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
