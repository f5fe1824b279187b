"""Tokens to their experts' ranks and back: the all-to-all dispatch of one MoE layer.

A transformers experts module is called as experts(hidden (T, H), top_k_index (T, K),
top_k_weights (T, K)) after the model's own router has chosen; it computes, for each token t,

    y_t = sum_j w_tj * down_e(act(gate_e(x_t)) * up_e(x_t)),   e = top_k_index[t, j]

with every expert's weights packed in gate_up_proj (E, 2I, H) and down_proj (E, H, I).
`ShardedExperts` replaces it and keeps experts [k*E/ep, (k+1)*E/ep) on ep rank k:

    1. the T*K routed rows sorted by expert: rows for ep rank k are a contiguous run
    2. counts exchanged (an all-to-all of E integers): each rank learns how many rows every
       peer sends each of its experts; the split sizes come to the host (one sync per layer)
    3. rows dispatched (all-to-all, uneven counts), computed by their experts, combined back
       (the reverse all-to-all), weighted and summed per token as the model does

Every routed row is computed: dropless, unless Plan.capacity_factor has turned the choices
over capacity into "no expert" (models/experts.py), which are neither sent nor counted. Both
all-to-alls are differentiable (`AllToAll`: the same exchange with the splits swapped in
backward), so an expert's gradient on its rank sums the contributions of every token of the
ep group routed to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.models.experts import training_forward


class AllToAll(torch.autograd.Function):
    """Forward: rows of x in `send` counts to each ep rank, `receive` counts back from each.
    Backward: the gradients the same way reversed (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], comm: Comm,
                tag: str) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.comm, ctx.tag = send, receive, comm, tag
        out = x.new_empty((sum(receive), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), "ep", tag, receive, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.comm.all_to_all(out, grad.contiguous(), "ep", ctx.tag + "-grad", ctx.send,
                            ctx.receive)
        return out, None, None, None, None


class ShardedExperts(nn.Module):
    """This ep rank's experts of one MoE layer, under the packed parameters' own names
    (gate_up_proj, down_proj: their first E/ep rows), called as the module it replaces."""

    skips_no_expert = True   # index E rows: neither sent nor computed (models/experts.py)

    def __init__(self, whole: nn.Module, comm: Comm) -> None:
        super().__init__()
        ep, k = comm.mesh.size("ep"), comm.mesh.axis_rank("ep")
        self.experts = whole.gate_up_proj.shape[0]
        self.local = self.experts // ep
        self.first = k * self.local
        self.comm, self.act_fn = comm, whole.act_fn
        mine = slice(self.first, self.first + self.local)
        self.gate_up_proj = _slice(whole.gate_up_proj, mine)
        self.down_proj = _slice(whole.down_proj, mine)
        self.sent = torch.zeros(ep, dtype=torch.int64)     # rows routed, per destination rank
        self.per_expert = torch.zeros(self.experts, dtype=torch.int64)  # this rank's routing

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.local - 1} of {self.experts} "
                f"(ep rank {self.comm.mesh.axis_rank('ep')})")

    @torch.compiler.disable   # row counts change every step: compiled, it would recompile
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ep = self.comm.mesh.size("ep")
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)                       # (T*K,) expert of each routed row
        order = torch.argsort(flat, stable=True)             # rows grouped by expert
        # (E,) rows per expert; an index E means "no expert" to transformers: sorted last, cut
        counts = torch.bincount(flat, minlength=self.experts + 1)[:self.experts]
        arriving = torch.empty_like(counts)                  # (ep * E/ep,) from each peer
        self.comm.all_to_all(arriving, counts, "ep", tag="ep-counts")   # E/ep to each
        per_peer = arriving.view(ep, self.local)             # (ep, E/ep) rows peer -> expert
        routed = counts.cpu().view(ep, self.local)           # one copy to the host, read twice
        send = routed.sum(dim=1).tolist()
        receive = per_peer.sum(dim=1).tolist()
        order = order[:sum(send)]
        token = order // k                                   # the token each sorted row copies
        if training_forward():   # not evaluation, not recomputation inside backward
            self.sent += routed.sum(dim=1)
            self.per_expert += routed.view(-1)
        rows = AllToAll.apply(hidden[token], send, receive, self.comm, "ep-dispatch")
        out = self._compute(rows, per_peer)                  # (R, H) in arrival order
        back = AllToAll.apply(out, receive, send, self.comm, "ep-combine")   # (T*K, H)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden)
        return final.index_add_(0, token, weighted.to(final.dtype))

    def _compute(self, rows: torch.Tensor, per_peer: torch.Tensor) -> torch.Tensor:
        """Each arriving row through its expert. Rows arrive by peer, then by expert: they
        are grouped by expert for the matmuls and put back in arrival order. Every local
        expert runs, on zero rows if none came, so that its weights get a (zero) gradient
        as the packed parameter's rows do in one process."""
        local = torch.arange(self.local, device=rows.device).repeat(per_peer.shape[0])
        expert_of = torch.repeat_interleave(local, per_peer.reshape(-1).to(rows.device))
        by_expert = torch.argsort(expert_of, stable=True)
        chunks = rows[by_expert].split(per_peer.sum(dim=0).tolist())
        outs = []
        for e, x in enumerate(chunks):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs)[torch.argsort(by_expert)]   # back in arrival order

    def take_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows sent to each ep rank, rows routed to each expert) since the last call."""
        sent, per_expert = self.sent.clone(), self.per_expert.clone()
        self.sent.zero_()
        self.per_expert.zero_()
        return sent, per_expert


def _slice(whole: nn.Parameter, rows: slice) -> nn.Parameter:
    """A parameter of `whole`'s rows `rows`: a copy (the whole is dropped), or a meta tensor
    of that shape where the model is not real yet (strategies/materialise.py fills it)."""
    part = whole.detach()[rows]
    part = part if part.device.type == "meta" else part.clone()
    return nn.Parameter(part, requires_grad=whole.requires_grad)
