"""Compiled blocks (`Plan(compile=True)`): torch.compile applied to each transformer block,
as torchtitan's `apply_compile` does, with the model's own structure and names kept.

Each block's `forward` is replaced by its compiled version; the module stays where it is
(no `_orig_mod.` in any name, state dicts unchanged). Where the other strategies meet it:

- Module hooks run in `Module.__call__`, around `forward`: ZeRO-3's gather before a unit
  and free after it stay outside the compiled region; the compiled graph takes the gathered
  parameters as inputs at every call (parameters are graph inputs, not constants), and the
  tensors it saves for backward are views of the unit's one storage, which ZeRO-3 resizes
  back before the unit's backward ([Note: one storage per unit], zero/zero3.py).
- Gradient hooks (DDP's, ZeRO's buckets) fire on each parameter's gradient accumulation,
  after the compiled backward has produced the gradient: outside as well.
- Collectives (tensor parallel's autograd functions, sequence parallel's gathers) are never
  traced: each region function is a graph break that runs eagerly through the accounted
  `Comm`, and a block under tp compiles as the graphs between them
  ([Note: collectives are never compiled], tensor_parallel/communications.py).
- Recomputation (applied after this) wraps the compiled forward in `checkpoint`: backward
  runs the same compiled graph again; nothing of checkpoint is traced.
- Pipeline stages keep the block modules, compiled forward and all.
- The parameter server (sync and async), local SGD and DiLoCo act on gradients and
  parameters between steps, never in forward: they compose unchanged.
- DP with a master device deep-copies the model into replicas run in threads: each copy's
  blocks get a compiled forward of their own (`recompile_copy`); dynamo serialises
  compilation under its lock and its frame callback is per thread.
- Zero bubble (zb-h1) is refused (core/admit.py): a compiled backward is one graph that
  computes input and weight gradients together.

With compile="cudagraphs" (inductor, mode="reduce-overhead") each compiled graph is
replayed as a CUDA graph: one launch instead of a launch per kernel, for a step whose host
work outlasts its GPU work (a small model, a small batch). CUDA graph trees keep a recording
per block (each reads its own parameters at fixed addresses) and assume one step's graphs
run after another's; admit.py refuses the plans that break this (ZeRO-3, tensor parallel,
pipelines, recomputation, replicas in threads).

Graphs are static (`dynamic=False`): one per input shape, grad mode and parameter layout;
blocks of one class share them, since parameters are inputs.

The token cross-entropy (the GPT's `loss`, `token_cross_entropy`) is compiled too, with its
upcast to fp32 (`compiled_token_loss`): eagerly the loss makes fp32 copies of the logits
(the upcast, the log-probabilities, backward's gradient and its cast back), each a pass
over B x T x V elements, the largest tensors of a small model's step; compiled, the upcast
and the softmax fuse into a few passes that read the logits as they are. Without tensor
parallel only: a vocab-parallel loss keeps its collectives eager. Any other loss runs as
given (a user's loss could break the graph anywhere).
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from meshtrain.models.registry import logits_of, token_cross_entropy
from meshtrain.models.structure import units_of


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """What is compiled: the units recomputation and ZeRO-3 use (a transformers causal LM's
    decoder layers, the GPT's `layers()`, or the children), those of a class that repeats
    (the GPT's blocks, without its embedding and head); all of them where none repeats."""
    units = [u for u in units_of(model) if any(True for _ in u.parameters())]
    repeats = Counter(type(u) for u in units)
    return [u for u in units if repeats[type(u)] > 1] or units


def apply_compile(model: nn.Module, backend: str | None, mode: str | None = None) -> list[str]:
    """Compile each block's forward in place with `backend` (and torch.compile's `mode`:
    "reduce-overhead" replays CUDA graphs); returns the blocks' names (none where `backend`
    is None)."""
    if backend is None:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    blocks = blocks_of(model)
    for block in blocks:
        _compile_block(block, backend, mode)
    return [names[id(b)] for b in blocks]


def compiled_token_loss(backend: str, mode: str | None = None):
    """The mean token cross-entropy of (output, targets), compiled with the logits' upcast
    to fp32 (module docstring)."""
    compiled = torch.compile(_token_loss_in_fp32, backend=backend, mode=mode, dynamic=False)

    def loss(output, targets: torch.Tensor) -> torch.Tensor:
        return compiled(logits_of(output), targets)
    return loss


def _token_loss_in_fp32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.bfloat16, torch.float16):   # a float64 model keeps its own
        logits = logits.float()
    return token_cross_entropy(logits, targets)


def graph_step_marker(mode: str | None) -> Callable[[], None]:
    """What runs before each micro-batch's forward: under CUDA graphs, torch's mark that a
    new step begins (the previous micro-batch's graph outputs are all consumed: its backward
    ran and the buckets copied its gradients out), so CUDA graph trees replay the recorded
    graphs on their fast path instead of checking which earlier outputs are still alive;
    nothing otherwise."""
    if mode == "reduce-overhead":
        return torch.compiler.cudagraph_mark_step_begin
    return lambda: None


def _compile_block(block: nn.Module, backend: str, mode: str | None = None) -> None:
    block.forward = torch.compile(block.forward, backend=backend, mode=mode, dynamic=False)
    block._compile_backend = backend, mode   # kept by deepcopy: see recompile_copy


def recompile_copy(model: nn.Module) -> None:
    """A deep copy of a compiled model keeps the original's compiled `forward` (a function,
    which deepcopy shares), so its blocks would run the original's parameters: compile the
    copy's own `forward` instead (DP with a master's replicas, master_dp.py)."""
    for block in model.modules():
        backend = block.__dict__.get("_compile_backend")
        if backend is not None:
            del block.forward   # the instance attribute: back to the class's forward
            _compile_block(block, *backend)


def limit_compile_workers() -> None:
    """Inductor sizes each process's pool of compile workers by the machine's cores, so N
    ranks on one machine would start N pools of that size: keep each rank's to its share,
    the intra-op thread count the launcher set (core/processes.py's `threads_per_rank`; 1
    compiles in the process). TORCHINDUCTOR_COMPILE_THREADS, where set, still decides."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    from torch._inductor import config   # here: a slow import that only compile needs

    config.compile_threads = torch.get_num_threads()
