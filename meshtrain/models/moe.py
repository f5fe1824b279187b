"""Mixture-of-experts causal LMs as transformers builds them (Mixtral, Qwen3-MoE, OLMoE,
Qwen2-MoE...): their router's auxiliary loss kept, as transformers adds it.

With `output_router_logits=True` in its config, transformers' causal LM adds
`router_aux_loss_coef x` the load-balancing loss (Switch Transformer, eqs. 4-6) to the loss it
computes from labels:

    aux = E * sum_e f_e * P_e     f_e: the fraction of the top-k choices that went to expert e
                                  P_e: the mean router probability of expert e
                                  both over every token of every MoE layer in the batch

[Note: the load-balancing loss over data-parallel shards] f and P are means over the batch,
and their product is not: the mean over dp ranks of each shard's own aux is not the aux of
the global batch. f carries no gradient (top-k choices, counted), so the global aux is linear
in the probabilities once f is known: each rank sums its routing counts over dp (one
all-reduce of E + 1 numbers per micro-batch) and computes E * sum_e f_e(global) * P_e(its
shard). The mean of that over equal shards is the global aux exactly, and so are its
gradients: one process on the global batch gets the same loss and the same step. With
micro-batches, f is taken over micro-batch m of every rank (the global micro-batch m), as
one process accumulating gradients over the same global micro-batches computes it.
Under context parallel each cp rank routes its own chunks of every sequence, so the counts
are summed over dp x cp (the replica axis) in training, and over cp in evaluation, where
each dp rank has whole batches of its own (then the counts are otherwise the rank's own).
No causal MoE family in transformers has a router z-loss (only the encoder-decoder Switch
Transformers and NLLB-MoE), so none is added.

[Note: routing carried through pipeline stages] Under pp the last stage computes the loss
but holds only its own layers' router logits. Each stage sums its layers' routing into
the two vectors the loss needs, [counts (E + 1), prob_sum (E)] (`layer_routing`, the
same sums in the same order as one process), added to what the previous stage sent and
sent on beside the hidden state (models/hf_stages.py): 2E + 1 numbers per micro-batch,
whatever the sequence length. The last stage has the totals and computes aux as above;
the gradient of prob_sum goes back with the hidden state's, to every stage's routers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from meshtrain.core.plan import Plan, PlanError
from meshtrain.models.gpt import GPTConfig


@dataclass(frozen=True)
class Router:
    """What the model's config says of its routing: `experts` per MoE layer, each token to
    `top_k` of them; `aux_coef` the weight of the load-balancing loss, None where the config
    does not ask for it (output_router_logits False: transformers adds nothing)."""
    experts: int
    top_k: int
    aux_coef: float | None


def router_of(model) -> Router | None:
    """The routing of a transformers mixture-of-experts causal LM or of meshtrain's GPT with
    experts (its loss always asked for, where its coefficient is not 0), None for any other
    model."""
    return router_of_config(getattr(model, "config", None))


def router_of_config(config) -> Router | None:
    """`router_of` from the model's config alone (a transformers config or a GPTConfig)."""
    if isinstance(config, GPTConfig):
        coef = config.router_aux_coef or None
        return Router(config.experts, config.top_k, coef) if config.experts else None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts < 1:
        return None
    asks = bool(getattr(config, "output_router_logits", False))
    coef = getattr(config, "router_aux_loss_coef", getattr(config, "aux_loss_coef", 0.0))
    return Router(experts, top_k, float(coef) if asks else None)


def check(model, plan: Plan) -> None:
    """Refuse, before any process group exists, what a mixture of experts cannot run yet."""
    router = router_of(model)
    if router is None:
        return
    name = f"{type(model).__name__} ({router.experts} experts, top-{router.top_k})"
    if router.top_k > router.experts:
        raise PlanError(f"{name}: num_experts_per_tok={router.top_k} is more than its "
                        f"{router.experts} experts; set num_experts_per_tok <= {router.experts}")
    gpt = isinstance(getattr(model, "config", None), GPTConfig)   # keeps its own logits
    if plan.pp > 1 and router.aux_coef is not None and not gpt and router_recorder(model) is None:
        raise PlanError(f"{name} with pp={plan.pp}: its router's loss is carried between "
                        "stages from the router logits transformers records "
                        "(_can_record_outputs['router_logits']), which this family does not "
                        "declare; use pp=1, or output_router_logits=False")
    if plan.pp > 1 and plan.compile is not False:
        raise PlanError(f"{name} with pp={plan.pp} and compile={plan.compile!r}: compiled "
                        "mixture-of-experts layers are not built under pipeline stages yet; "
                        "drop compile, or use pp=1")
    if plan.tp > 1 and plan.sequence_parallel:
        raise PlanError(f"{name} with tp={plan.tp}, sequence_parallel=True: its experts stay "
                        "whole over tp and would route each rank's slice of the sequence "
                        "alone; drop sequence_parallel")
    if router.aux_coef is not None and plan.dp_mode != "ddp":
        raise PlanError(f"{name} with dp_mode={plan.dp_mode!r}: its router's load-balancing "
                        "loss (output_router_logits=True) needs the routing counts of the "
                        "whole batch every step, which only dp_mode='ddp' (DDP, ZeRO) "
                        "gathers; use dp_mode='ddp', or output_router_logits=False")


def router_recorder(model) -> tuple[type, int] | None:
    """(the router's module class, the index of its logits in the router's output), as the
    model's `_can_record_outputs` declares them for transformers' own recording; None
    where it declares none."""
    recorder = getattr(getattr(model, "base_model", None), "_can_record_outputs",
                       None) or {}
    recorder = recorder.get("router_logits")
    if isinstance(recorder, type):
        return recorder, 0
    target = getattr(recorder, "target_class", None)
    return (target, recorder.index or 0) if isinstance(target, type) else None


def layer_routing(logits: torch.Tensor, router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's ([top-k choices of each expert..., tokens], each expert's summed
    probability) from its router logits (tokens, experts); the first carries no gradient."""
    probs = torch.softmax(logits, dim=-1)     # in the logits' dtype, as transformers
    chosen = torch.topk(probs, router.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=router.experts).float()
    counts = torch.cat([counts, counts.new_tensor([probs.shape[0]])])
    return counts, probs.float().sum(dim=0)


def router_loss(model, loss_fn: Callable, reduce_counts: Callable,
                reduce_chunks: Callable | None = None) -> RouterLoss | None:
    """`loss_fn` plus the router's auxiliary loss where the model's config asks for it
    (see the module docstring); None where it does not. `reduce_counts(t)` sums a tensor
    in place over the data-parallel ranks (x cp); `reduce_chunks(t)` over the cp ranks
    holding chunks of the same sequences (evaluation; None without cp)."""
    router = router_of(model)
    if router is None or router.aux_coef is None:
        return None
    return RouterLoss(loss_fn, router, reduce_counts, reduce_chunks)


class RouterLoss:
    """loss = loss_fn(output, targets) + aux_coef * aux, aux over the global batch; each
    training call's parts (the loss_fn's, aux unscaled) kept until `take_parts`."""

    def __init__(self, loss_fn: Callable, router: Router, reduce_counts: Callable,
                 reduce_chunks: Callable | None = None) -> None:
        self.loss_fn, self.router, self.reduce_counts = loss_fn, router, reduce_counts
        self.reduce_chunks = reduce_chunks
        self._parts: list[torch.Tensor] = []

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, targets)
        carried = getattr(output, "routing", None)   # pp: the stages' sums (see the note)
        layers = getattr(output, "router_logits", None)
        if carried is None and not layers:
            raise RuntimeError("the model's output carries no router_logits although its "
                               "config sets output_router_logits=True (its router loss is "
                               "added from them); call the model without "
                               "output_router_logits=False, or set it False in the config")
        training = torch.is_grad_enabled()   # evaluation: whole batches, counts its own
        if carried is None:
            aux = self.balancing(layers, training)
        else:   # f carries no gradient; prob_sum's goes back through every stage
            experts = self.router.experts
            aux = self.aux(carried[:experts + 1].detach().clone(), carried[experts + 1:],
                           training)
        if training:
            self._parts.append(torch.stack([loss.detach().float(), aux.detach()]))
        return loss + self.router.aux_coef * aux.to(loss.dtype)

    def balancing(self, layers, global_counts: bool) -> torch.Tensor:
        """transformers' load_balancing_loss_func, f from the counts summed over dp."""
        return self.aux(*self.routed(layers), global_counts)

    def aux(self, counts: torch.Tensor, prob_sum: torch.Tensor,
            global_counts: bool) -> torch.Tensor:
        """E * sum_e f_e * P_e from the routing sums (`routed`'s); `counts` summed in place
        over dp (x cp) where `global_counts`, else over cp's chunks (evaluation)."""
        rows = counts[-1].clone()                     # this rank's own, for P
        if global_counts:
            self.reduce_counts(counts)
        elif self.reduce_chunks is not None:   # evaluation under cp: the whole sequences
            self.reduce_chunks(counts)
        f = counts[:-1] / counts[-1]
        return self.router.experts * (f * (prob_sum / rows)).sum()

    def routed(self, layers) -> tuple[torch.Tensor, torch.Tensor]:
        """([top-k choices of each expert..., tokens], each expert's summed probability)
        over every MoE layer's tokens; the first is what dp sums, the second has gradients."""
        experts, device = self.router.experts, layers[0].device
        counts = torch.zeros(experts + 1, dtype=torch.float32, device=device)
        prob_sum = torch.zeros(experts, dtype=torch.float32, device=device)
        for logits in layers:                         # (tokens, experts) per MoE layer
            layer_counts, layer_probs = layer_routing(logits, self.router)
            counts = counts + layer_counts
            prob_sum = prob_sum + layer_probs
        return counts, prob_sum

    def take_parts(self) -> torch.Tensor | None:
        """[loss_fn's, aux] of the step's micro-batches, averaged (equal micro-batches); the
        kept parts are cleared. None where this rank computed no loss (a pp stage before
        the last)."""
        parts, self._parts = self._parts, []
        return torch.stack(parts).mean(dim=0) if parts else None
