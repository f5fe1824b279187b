"""What a model's training step does, read by running it on fake tensors (torch's
FakeTensorMode: shapes, dtypes and storages, no memory and no arithmetic), so the planner
can price a model whose blocks are not a GPT's (a transformers Llama's RMSNorm keeps an
fp32 copy of its input; GPT-2's GELU is built from several saved ops):

- the bytes one decoder layer saves for backward per token, in each compute precision
  (autograd's saved tensors while the layer runs, parameters and views counted once, as
  core/memory.ActivationMeter counts them on a real step);
- the bytes one decoder layer keeps under per-op selective recomputation (what the
  policy of strategies/recompute.py keeps: the layer's input and the outputs of its
  SAVED_OPS, traced through the policy itself), in each precision;
- the bytes its elementwise operators (all but the matmuls and attention) read and write
  in a step, against those of meshtrain's GPT of the same width, depth, heads and
  vocabulary: the time model's elementwise work (planner/flops.ELEMENTWISE_BYTES, a
  GPT's) scales with it.

Not scaled: the host's dispatch. A Llama step dispatches about twice a GPT's operators,
but timed on CPU ranks its fixed cost per block was about 1.3 times a GPT's, and pipeline
stages (which skip transformers' own forward) paid a GPT's.

Fake tensors live on the CPU, so attention takes the CPU's fused kernel, which saves what a
GPU's flash kernel saves (the output and its log-sum-exp).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshtrain.models import hf, structure
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.strategies.recompute import apply_recompute

PRECISIONS = {4: torch.float32, 2: torch.bfloat16}   # element bytes -> compute dtype
NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "baddbmm", "_unsafe_view"}   # and attention's


@dataclass(frozen=True)
class Traced:
    """Per precision, (element bytes, value) pairs: the bytes per token one decoder layer saves
    (on average over the layers) and the model saves after its last one (the final norm
    and the output layer's input; the loss, outside the model, not included), the
    elementwise bytes of a step against a GPT's of its shape, and the bytes per token one
    decoder layer keeps under per-op selective recomputation."""
    layer_bytes: tuple[tuple[int, float], ...]
    head_bytes: tuple[tuple[int, float], ...]
    elementwise_scale: tuple[tuple[int, float], ...]
    selective_bytes: tuple[tuple[int, float], ...] = ()


class _ElementwiseBytes(TorchDispatchMode):
    """The bytes elementwise operators read and write (views, which move nothing, and fake
    mode's own device queries, prims, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.elementwise = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.namespace == "prim":
            return out
        name = func._opname
        if name not in NOT_ELEMENTWISE and "scaled_dot_product" not in name:
            self.elementwise += sum(t.numel() * t.element_size() for t in
                                    tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def trace(build: Callable[[], nn.Module], loss: Callable, seq: int) -> Traced:
    """`build()` (a causal LM reading token ids, whose `loss(output, tokens)` trains it)
    traced at `seq` tokens in each of PRECISIONS."""
    layer_bytes, head_bytes, scale, selective = [], [], [], []
    for elem, dtype in PRECISIONS.items():
        model = _trace_one(build, loss, seq, dtype)
        layer_bytes.append((elem, model["layer"]))
        head_bytes.append((elem, model["head"]))
        selective.append((elem, model["selective"]))
        if model["gpt"] is not None:   # meshtrain's GPT itself: the scale's own reference
            gpt = _trace_one(lambda: GPT(model["gpt"]), None, seq, dtype)
            scale.append((elem, model["elementwise"] / gpt["elementwise"]))
    return Traced(tuple(layer_bytes), tuple(head_bytes), tuple(scale), tuple(selective))


def _trace_one(build: Callable[[], nn.Module], loss: Callable | None, seq: int,
               dtype: torch.dtype) -> dict:
    """Per token: the bytes a decoder layer saves (on average over the layers) and the
    model after them, the elementwise bytes of a step, what a layer keeps under per-op
    selective recomputation; the GPTConfig of meshtrain's GPT of this model's shape.
    `loss` None: the model's own `.loss`."""
    default = torch.get_default_dtype()
    with FakeTensorMode(), _as_eager(), _fused_attention(), _quiet():
        torch.set_default_dtype(dtype)   # built in `dtype`, as Plan(precision=...) runs it
        try:
            model = build().train()
        finally:
            torch.set_default_dtype(default)
        if hf.is_causal_lm(model):
            hf.prepare(model)   # as the Trainer runs it: no KV cache
        loss = loss or model.loss
        layers = structure.units_of(model)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved: dict[str, dict[int, int]] = {}   # "layers" | "head" -> storage -> bytes
        now = [None]   # where the forward is: "layers", "head" (after the last), None

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if now[0] is not None and storage._cdata not in params:
                saved[now[0]][storage._cdata] = storage.nbytes()
            return t

        def at(where):
            return lambda *hook_args: now.__setitem__(0, where)

        handles = [layer.register_forward_pre_hook(at("layers")) for layer in layers]
        handles += [layers[-1].register_forward_hook(at("head")),
                    model.register_forward_hook(at(None))]
        device = next(model.parameters()).device   # fake tensors' own

        def step(batch: int) -> list[int]:
            """One step of `batch` sequences: bytes saved by the layers, by the head, and
            the elementwise bytes."""
            saved.update(layers={}, head={})
            tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with _ElementwiseBytes() as count, hooks:
                loss(model(tokens), tokens).backward()
            model.zero_grad(set_to_none=True)   # the next pass makes its gradients anew
            return [sum(saved["layers"].values()), sum(saved["head"].values()),
                    count.elementwise]

        def kept(batch: int) -> int:
            """Bytes the layers keep under per-op selective, through its own policy: what it
            holds as a layer runs forward (the layer's input, its kept ops' outputs)."""
            saved.update(layers={}, head={})
            model(torch.zeros(batch, seq, dtype=torch.long, device=device))
            return sum(saved["layers"].values())

        # one sequence, then two: their difference is what grows with the tokens (RoPE's
        # tables, for one, are saved once per batch)
        per_batch = [step(batch) for batch in (1, 2)]
        apply_recompute(model, "selective", keep=lambda tensors: [pack(t) for t in tensors])
        selective = [kept(batch) for batch in (1, 2)]
        for h in handles:
            h.remove()
    layer, head, elementwise = ((two - one) / seq for one, two in zip(*per_batch))
    return {"layer": layer / len(layers), "head": head, "elementwise": elementwise,
            "selective": (selective[1] - selective[0]) / seq / len(layers),
            "gpt": _gpt_like(model, seq)}


@contextmanager
def _as_eager():
    """transformers builds an explicit causal mask (and repeats grouped key/value heads for
    it) when it sees a fake tensor, taking it for a compiler's trace; a real step skips the
    mask, once it has read the positions and found one sequence per row (which a fake
    tensor cannot be read for; the trace's rows are one sequence each). The trace must run
    what the real step runs."""
    masking = sys.modules.get("transformers.masking_utils")
    names = ("is_tracing", "find_packed_sequence_indices")
    if masking is None or not all(hasattr(masking, name) for name in names):
        yield
        return
    with mock.patch.object(masking, "is_tracing", lambda tensor=None: False), \
            mock.patch.object(masking, "find_packed_sequence_indices", lambda positions: None):
        yield


@contextmanager
def _quiet():
    """transformers' warnings about the config were said when it was built on the meta
    device (trained_model.model_of); the trace builds it twice more. An op fake tensors
    cannot run (grouped_mm's meta kernel takes bf16 only) raises, and the caller prices
    the model from its shapes instead: torch's own log of it, a traceback, stays unsaid."""
    import logging

    fake = logging.getLogger("torch._subclasses.fake_tensor")
    logs = sys.modules.get("transformers.utils.logging")
    level = logs.get_verbosity() if logs is not None else None
    if logs is not None:
        logs.set_verbosity_error()
    fake.disabled, was = True, fake.disabled
    try:
        yield
    finally:
        fake.disabled = was
        if logs is not None:
            logs.set_verbosity(level)


@contextmanager
def _fused_attention():
    """Attention's dropout as a GPU's fused kernel runs it: inside the kernel, keeping only
    its random state. The CPU's fused kernel has no dropout and falls back to materialising
    the scores (s x s per head, and their mask), which no GPU run keeps: traced without it."""
    fused = torch.nn.functional.scaled_dot_product_attention

    def without_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return fused(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", without_dropout):
        yield


def _gpt_like(model: nn.Module, seq: int) -> GPTConfig | None:
    """meshtrain's GPT with `model`'s width, depth, heads and vocabulary (None for a GPT)."""
    config = model.config
    if isinstance(config, GPTConfig):
        return None
    width = getattr(config, "hidden_size", None) or config.n_embd
    return GPTConfig(vocab_size=config.vocab_size, seq_len=seq, d_model=width,
                     n_layer=len(structure.units_of(model)),
                     n_head=getattr(config, "num_attention_heads", None) or config.n_head)
