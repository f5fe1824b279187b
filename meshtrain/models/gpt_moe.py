"""The GPT's mixture-of-experts feed-forward (`GPTConfig(experts=E, top_k=K)`): Mixtral's
routing over experts in transformers' packed layout, so that what splits, shards and counts
a transformers mixture (strategies/expert_parallel, the edp gradient groups, the router's
loss in models/moe.py) takes the GPT's as it is.

For a token x (d,), with the router's logits l = W_g x (E,):

    p = softmax(l)                       over all E experts, in fp32
    (w, e) = top-k of p, w renormalised  w_j = p_ej / sum_i p_ei   (Mixtral's)
    y = sum_j w_j down_ej(silu(gate_ej(x)) * up_ej(x))             SwiGLU experts

Each expert is a SwiGLU MLP of width I = mlp_ratio x d, without biases, its weights packed as
transformers' Mixtral packs them: gate_up_proj (E, 2I, d) (gate rows, then up rows) and
down_proj (E, d, I); `Experts` is called as transformers' experts are, experts(hidden (T, d),
top_k_index (T, K), top_k_weights (T, K)), which is what expert parallel's ShardedExperts
replaces. The router's logits of every MoE layer leave the model beside its logits
(`MoEOutput`), where the load-balancing loss reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEOutput:
    """What a GPT with experts returns: its logits (B, T, V) and, per MoE block, the router's
    logits (B*T, E), as transformers' MoE outputs carry them (`router_logits`)."""
    logits: torch.Tensor
    router_logits: tuple[torch.Tensor, ...]


class Experts(nn.Module):
    """E SwiGLU experts in transformers' packed layout, computed in one process: each
    expert on the rows routed to it, weighted, summed per token."""

    def __init__(self, d_model: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.act_fn = F.silu   # SwiGLU's gate, as Mixtral's hidden_act="silu"

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden (T, d), top_k_index (T, K), top_k_weights (T, K) -> (T, d)."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)     # (R,) rows routed to e
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])    # (R, d)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class MoEFeedForward(nn.Module):
    """The router `gate` (d -> E, no bias) and the experts: (B, T, d) -> (B, T, d). Keeps the
    router's logits of its last forward for the model's output (`take_router_logits`)."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.experts = Experts(d_model, hidden, experts)
        self._router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        logits = self.gate(flat)                                   # (B*T, E)
        probs = F.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)    # (B*T, K) each
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if torch._C._current_graph_task_id() == -1:   # not a recomputation inside backward
            self._router_logits = logits
        return self.experts(flat, chosen, weights).view(B, T, d)

    def take_router_logits(self) -> torch.Tensor:
        logits, self._router_logits = self._router_logits, None
        return logits
