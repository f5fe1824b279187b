"""A mixture of experts' experts modules, and the capacity factor that limits what they take.

Each MoE layer's experts module (transformers' packed layout: gate_up_proj (E, 2I, H),
down_proj (E, H, I)) is called as experts(hidden (T, H), top_k_index (T, K), top_k_weights
(T, K)) after the model's own router has chosen.

[Note: capacity per sequence] Plan.capacity_factor = C limits each expert of each MoE layer
to at most

    c = ceil(C * S * K / E)

of the top-k choices routed to it from each sequence of S tokens (Switch Transformer's and
GShard's capacity, counted per sequence). Within a sequence the choices are kept in order of
token position, then choice rank (flat order t * K + j: Megatron-Core's "position" drop
policy); the rest are dropped: the choice's weight becomes 0, so it adds nothing to the
token's output (the others' weights are not renormalised) and the residual stream carries
the token on. A whole experts module still computes the dropped row (times 0: exactly
nothing, forward and backward; transformers' grouped_mm leaves "no expert" rows
uninitialised outside its own expert parallel); one that skips "no expert" rows
(`skips_no_expert`: expert parallel's dispatch) gets index E as well, so the row is not
sent. Counted per sequence, the kept choices depend on nothing a dp, ep or tp split
changes, so every plan drops exactly what one process drops. The router's load-balancing
loss reads the router's logits, before any drop (as Switch's).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from meshtrain.core.plan import Plan, PlanError
from meshtrain.models.moe import router_of

PACKED = ("gate_up_proj", "down_proj")


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Each MoE layer's experts module by name: the packed layout transformers' Mixtral,
    Qwen3-MoE, OLMoE and others share (gate_up_proj (E, 2I, H), down_proj (E, H, I))."""
    return {name: m for name, m in model.named_modules()
            if all(getattr(getattr(m, p, None), "dim", lambda: 0)() == 3 for p in PACKED)}


def active_parameters(model: nn.Module) -> int:
    """The parameters one token's forward multiplies by: all of them, but each MoE layer's
    experts at top_k / experts of their size (a token meets only the experts it is routed
    to; what MFU counts, as the planner's ModelSpec does)."""
    total = sum(p.numel() for p in model.parameters())
    router = router_of(model)
    if router is None:
        return total
    for experts in experts_modules(model).values():
        size = sum(p.numel() for p in experts.parameters())
        total -= size - size * router.top_k // router.experts
    return total


def training_forward() -> bool:
    """A forward that trains: not evaluation, not a recomputation inside backward (what the
    routing counters count)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def capacity(factor: float, seq_len: int, top_k: int, experts: int) -> int:
    """Choices one expert accepts from one sequence: ceil(C S K / E)."""
    return math.ceil(factor * seq_len * top_k / experts)


def kept_choices(top_k_index: torch.Tensor, seq_len: int, experts: int,
                 factor: float) -> torch.Tensor:
    """(T, K) True where the choice is kept: T = B S tokens, whole sequences of `seq_len`
    in order; each expert keeps its first c choices of each sequence in flat order."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1, seq_len * k)                   # (B, S*K) per sequence
    seq = torch.arange(flat.shape[0], device=flat.device)[:, None]
    key = (seq * (experts + 1) + flat).reshape(-1)                # (B*S*K,) sequence, expert
    order = torch.argsort(key, stable=True)                       # each group in flat order
    grouped = key[order]
    first = torch.searchsorted(grouped, grouped)                  # its group's first place
    place = torch.empty_like(key)
    place[order] = torch.arange(key.numel(), device=key.device) - first   # rank in group
    kept = (place < capacity(factor, seq_len, k, experts)) & (flat.reshape(-1) < experts)
    return kept.view(tokens, k)


class CapacityLimit:
    """Plan.capacity_factor on every MoE layer of a model: a forward pre-hook on each
    experts module (whole or expert parallel's) drops the choices over capacity, one on its
    parent block reads the sequence length the block flattens away. Each layer's choices
    routed and dropped are counted on this rank's tokens, in training forwards."""

    def __init__(self, model: nn.Module, factor: float) -> None:
        self.factor, self.experts = factor, router_of(model).experts
        found = experts_modules(model)
        self.seq_len: list[int | None] = [None] * len(found)
        self.counts: list[torch.Tensor | None] = [None] * len(found)   # [routed, dropped]
        for i, name in enumerate(found):
            block = model.get_submodule(name.rpartition(".")[0])
            block.register_forward_pre_hook(functools.partial(self._sequence, i),
                                            with_kwargs=True)
            found[name].register_forward_pre_hook(functools.partial(self._limit, i))

    def _sequence(self, i: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.dim() != 3:
            raise RuntimeError(f"capacity_factor counts per sequence, but MoE block "
                               f"{type(module).__name__} got hidden states of shape "
                               f"{tuple(hidden.shape)}, not (batch, sequence, hidden)")
        self.seq_len[i] = hidden.shape[1]

    @torch.compiler.disable   # counters on the side: kept out of a compiled block's graph
    def _limit(self, i: int, module, args):
        hidden, index, weights = args
        kept = kept_choices(index, self.seq_len[i], self.experts, self.factor)
        if training_forward():
            routed = (index < self.experts).sum()
            step = torch.stack([routed, routed - kept.sum()])
            self.counts[i] = step if self.counts[i] is None else self.counts[i] + step
        if getattr(module, "skips_no_expert", False):   # not sent: fewer all-to-all bytes
            index = torch.where(kept, index, self.experts)
        return hidden, index, weights * kept.to(weights.dtype)

    def take(self) -> torch.Tensor:
        """(layers, 2): each layer's [choices routed, choices dropped] on this rank since
        the last call (zeros where nothing ran); the counters are cleared."""
        counts = [torch.zeros(2, dtype=torch.int64) if c is None else c.cpu()
                  for c in self.counts]
        self.counts = [None] * len(self.counts)
        return torch.stack(counts)

    def drops(self, reduce, device: torch.device) -> dict:
        """The choices dropped per layer since the last call over the global batch
        (`reduce(t)` sums t, on `device`, in place over the data-parallel ranks), and their
        fraction of the choices routed."""
        counts = self.take().to(device, torch.float64)
        reduce(counts)
        return {"expert_dropped": counts[:, 1].long().tolist(),
                "expert_drop_fraction": (counts[:, 1].sum() / counts[:, 0].sum().clamp(
                    min=1)).item()}


def limit_capacity(model: nn.Module, factor: float | None) -> CapacityLimit | None:
    """The capacity limit on `model`'s MoE layers, installed after expert parallel has
    replaced their experts modules; None for a dropless plan (factor None)."""
    return None if factor is None else CapacityLimit(model, factor)


def check_capacity(model: nn.Module, plan: Plan) -> None:
    """Refuse, before any process group exists, a capacity factor with no experts to limit."""
    if plan.capacity_factor is None:
        return
    if router_of(model) is None or not experts_modules(model):
        raise PlanError(f"Plan(capacity_factor={plan.capacity_factor}) limits the tokens each "
                        f"expert of a mixture-of-experts layer takes, and this "
                        f"{type(model).__name__} has none; drop capacity_factor "
                        "(--capacity-factor), or use a MoE model (e.g. --model mixtral-tiny)")
