"""Activation recomputation (`Plan(recompute="full" | "selective" | "attention")`): keep less
for backward, compute it again when backward needs it (Chen et al. 2016; Korthikanti et al.
2022).

- "full": every transformers decoder layer, or every element of the model's `layers()` or
  child but the last (models/structure.py), keeps only its input; its forward runs again
  inside backward. Per transformer layer that
  leaves s*b*h elements of the 34 s*b*h (16 in fp32, without dropout) a layer saves.
  `Plan.recompute_every=k` wraps only every k-th of these (torchtitan's frequency).
- "selective": the same layers, per op (torchtitan's selective checkpointing, through
  PyTorch's selective checkpoint API): the outputs of SAVED_OPS (matmuls, attention
  kernels, max) are kept from forward, every other op (norms, activations, residual adds,
  rotary, collectives) runs again in backward. What is expensive to recompute is kept, what
  is cheap and large (a Llama's fp32 norm copies, GELU's pieces) is not.
- "attention": only the attention core (softmax(QK^T)V) is recomputed: what it keeps that
  grows with s^2 is dropped (Korthikanti et al. §4). A model must expose its cores as modules
  (meshtrain's GPT: `AttentionCore`). With a fused attention kernel the core keeps no s^2
  tensor in the first place, so selective saves nearly nothing there (the planner's formula
  says the same) and only costs the core's recomputation.
A `layers()` list's or children's last (the output layer and loss) is not wrapped: its
backward follows its forward at once. A transformers model's output layer is not among its
decoder layers, so all of those are (as Megatron and transformers' own gradient
checkpointing do, and as the planner counts).

Built on torch.utils.checkpoint (non-reentrant): a wrapped module's forward runs through
`checkpoint`, its hooks (ZeRO-3's gathers) stay outside it.
"""
from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from meshtrain.core.plan import PlanError
from meshtrain.models import hf
from meshtrain.models.structure import units_of


aten = torch.ops.aten
# what "selective" keeps (torchtitan's list, every matmul kept, without its collectives:
# meshtrain's tensor-parallel collectives run again in backward, as under "full")
SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten.max.default})


def apply_recompute(model: nn.Module, mode: str, keep: Callable | None = None,
                    every: int = 1) -> list[str]:
    """Wrap the modules `mode` recomputes, in place; returns their names. `keep(tensors)` is
    told what a wrapped module holds for backward outside autograd's saved tensors (its
    inputs; under "selective" the ops' outputs it keeps): activation accounting."""
    if mode == "none":
        return []
    names = {id(m): n for n, m in model.named_modules()}
    if mode in ("full", "selective"):
        modules = every_kth(recomputed_layers(model), every, type(model).__name__)
    else:
        modules = [m for m in model.modules() if type(m).__name__ == "AttentionCore"]
        if not modules:
            raise PlanError(f"recompute='attention' recomputes attention cores, and "
                            f"{type(model).__name__} exposes none (an AttentionCore module, as "
                            "meshtrain's GPT has); use recompute='selective' or 'full'")
    contexts = partial(_selective_contexts, keep) if mode == "selective" else None
    for module in modules:
        module.forward = partial(_recomputed, module.forward, keep, contexts)
    return [names[id(m)] for m in modules]


def recomputed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers "full" and "selective" wrap: the decoder layers, or the units but the last."""
    decoder = hf.decoder_layers(model)
    layers = decoder if decoder is not None else units_of(model)[:-1]
    return [m for m in layers if any(True for _ in m.modules())]


def every_kth(modules: list[nn.Module], every: int, model: str) -> list[nn.Module]:
    """Every `every`-th of the repeated layers (those of the most common type: the decoder
    layers, not an embedding before them), counted from the first: layers k-1, 2k-1, ..."""
    if every == 1:
        return modules
    kind = Counter(type(m) for m in modules).most_common(1)[0][0]
    repeated = [m for m in modules if type(m) is kind]
    if every > len(repeated):
        raise PlanError(f"Plan.recompute_every={every} is more than the {len(repeated)} "
                        f"layers {model} recomputes, so none would be; use "
                        f"recompute_every <= {len(repeated)}")
    return repeated[every - 1::every]


class _Policy:
    """One wrapped forward's choices: keep the outputs of SAVED_OPS, recompute the rest. An op
    that writes into a kept output (a bias added in place, tensor parallel's in-place
    all-reduce) is kept too, not run again: the kept output already holds what it wrote (run
    again on it, it would add the bias or sum over ranks twice). An op writing into a
    recomputed tensor runs again on the recomputed one."""

    def __init__(self, keep: Callable | None) -> None:
        self.keep = keep
        # storages of the outputs kept so far (by the storage itself: a fake tensor, as the
        # planner traces a model on, has no data pointer)
        self.kept: set[int] = set()

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in SAVED_OPS:
            outputs = [t for t in tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor)]
            self.kept.update(t.untyped_storage()._cdata for t in outputs)
            if self.keep is not None:   # held until backward: count it
                self.keep(outputs)
            return CheckpointPolicy.MUST_SAVE
        if self._writes_kept(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _writes_kept(self, op, args, kwargs) -> bool:
        schema = op._schema.arguments
        written = [args[i] if i < len(args) else kwargs.get(arg.name)
                   for i, arg in enumerate(schema)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        if op.namespace == "c10d" and args:   # c10d's schemas declare no writes: its
            written.append(args[0])           # collectives write into their first argument
        return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.kept
                   for t in tree_leaves(written))


def _selective_contexts(keep: Callable | None):
    # mutation of a kept entry is allowed: _Policy keeps the op that made it
    return create_selective_checkpoint_contexts(_Policy(keep), allow_cache_entry_mutation=True)


def _recomputed(forward: Callable, keep: Callable | None, contexts: Callable | None,
                *args, **kwargs):
    if keep is not None:
        keep([a for a in args if isinstance(a, torch.Tensor)])
    if not torch.is_grad_enabled():   # nothing will be recomputed: run it plainly
        return forward(*args, **kwargs)
    if contexts is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
