"""Tensor-parallel layers (Megatron, Shoeybi et al. 2019 §3): a Linear split by columns or by
rows, an embedding split by vocabulary rows.

Each layer holds only this rank's slice of its weight, under the original attribute names
(`weight`, `bias`), so a model keeps its parameter names when its layers are swapped for
these. Weights come in either layout: nn.Linear's (out, in), or transformers' Conv1D's
(in, out) (`conv1d=True`), and keep that layout, sliced.

The MLP pair: B·σ(A·x) with A split by columns (A_1 … A_T) and B by rows (B_1 … B_T) is
Σ_i B_i·σ(A_i·x) for an element-wise σ, so a column-parallel layer followed by a
row-parallel one communicates once in forward (the sum, in the row layer's `exit`) and once
in backward (the input gradient's sum, in the column layer's `enter`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.core.comm import Comm
from meshtrain.strategies.tensor_parallel.communications import (copy_to_tp, gather_from_sequence,
                                                                  gather_from_tp, reduce_from_tp,
                                                                  reduce_scatter_to_sequence,
                                                                  scatter_to_tp)
from meshtrain.strategies.tensor_parallel.sequence import Regather, linear_on_gathered


class Enter:
    """How a replicated input enters a tensor-parallel region: `copy_to_tp` (identity
    forward, all-reduce backward), or, under sequence parallel, `gather_from_sequence` (the
    input arrives split along `sequence_dim`: all-gather forward, reduce-scatter backward).

    Under sequence parallel it remembers, for as long as each gathered whole lives, the
    slice it came from: the column-parallel layers reading the whole save that slice
    instead (`gathered_slice`, sequence.py)."""

    def __init__(self, comm: Comm, tag: str, sequence_dim: int | None = None) -> None:
        self.comm, self.tag, self.sequence_dim = comm, tag, sequence_dim
        self._slices = WeakIdKeyDictionary()   # whole -> (its slice, its Regather)
        self._copies: WeakIdKeyDictionary | None = None   # input -> its copy (`share`)

    def share(self, module: nn.Module) -> None:
        """While `module` runs a forward, the column layers under it that take this entry
        and read one input share one copy of it: their input gradients are summed before
        one all-reduce, not all-reduced each (q, k and v projections apart: one all-reduce
        in backward where there were three, as Megatron's fused qkv); under sequence
        parallel, one gathered whole (one all-gather, one regather in backward)."""
        module.register_forward_pre_hook(self._start_sharing)
        module.register_forward_hook(self._stop_sharing)

    @torch.compiler.disable
    def _start_sharing(self, *_) -> None:
        self._copies = WeakIdKeyDictionary()

    @torch.compiler.disable
    def _stop_sharing(self, *_) -> None:
        self._copies = None

    @torch.compiler.disable
    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        if self._copies is None:
            return copy_to_tp(x, self.comm, self.tag)
        if x not in self._copies:
            self._copies[x] = copy_to_tp(x, self.comm, self.tag)
        return self._copies[x]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_dim is None:
            return self._copy(x)
        if self._copies is not None and x in self._copies:   # a sibling gathered it
            return self._copies[x]
        whole = gather_from_sequence(x, self.comm, self.sequence_dim, self.tag)
        if whole is not x:   # tp > 1
            self._slices[whole] = (x.detach(), Regather(self.comm, self.sequence_dim, self.tag))
        if self._copies is not None:
            self._copies[x] = whole
        return whole

    def gathered_slice(self, whole: torch.Tensor) -> tuple | None:
        """(slice, Regather) when `whole` is what this entry gathered, else None."""
        return self._slices.get(whole)

    def __repr__(self) -> str:
        if self.sequence_dim is None:
            return "copy_to_tp (all-reduce in backward)"
        return (f"gather_from_sequence(dim={self.sequence_dim}) (reduce-scatter in backward; "
                "its slice saved, gathered again in backward)")


class Exit:
    """How partial outputs leave a region: `reduce_from_tp` (all-reduce forward, identity
    backward), or, under sequence parallel, `reduce_scatter_to_sequence` (reduce-scatter
    along `sequence_dim` forward, all-gather backward)."""

    def __init__(self, comm: Comm, tag: str, sequence_dim: int | None = None) -> None:
        self.comm, self.tag, self.sequence_dim = comm, tag, sequence_dim

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_dim is None:
            return reduce_from_tp(x, self.comm, self.tag)
        return reduce_scatter_to_sequence(x, self.comm, self.sequence_dim, self.tag)

    def __repr__(self) -> str:
        if self.sequence_dim is None:
            return "reduce_from_tp (all-reduce)"
        return f"reduce_scatter_to_sequence(dim={self.sequence_dim}) (all-gather in backward)"


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            conv1d: bool, float8=None) -> torch.Tensor:
    """x·Wᵀ + b for nn.Linear's (out, in) layout, x·W + b for Conv1D's (in, out); the
    product in float8 where `float8` (strategies/float8.SplitFloat8: nn.Linear's layout)
    is given."""
    if float8 is not None:
        y = float8(x, weight)
        return y + bias if bias is not None else y
    if not conv1d:
        return F.linear(x, weight, bias)
    shape = (*x.shape[:-1], weight.shape[1])                       # (..., out)
    flat = x.reshape(-1, x.size(-1))                               # (tokens, in)
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(shape)


def _float8(layer: "_Sharded") -> str:
    return f", {layer.float8!r}" if layer.float8 is not None else ""


def _parameter(t: torch.Tensor) -> nn.Parameter:
    """`t` itself if it is a Parameter (a tied slice stays one object), else one made of it."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


class _Sharded(nn.Module):
    float8_split: str   # which operand of the product is a slice over tp besides the weight

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool,
                 full_in: int, full_out: int, rank: int, size: int) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.bias = _parameter(bias) if bias is not None else None
        self.conv1d = conv1d
        self.full_in, self.full_out = full_in, full_out
        self.tp_rank, self.tp_size = rank, size
        self.float8 = None   # the float8 product (strategies/float8.py) where precision is fp8

    @property
    def in_features(self) -> int:
        return self.weight.shape[0 if self.conv1d else 1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1 if self.conv1d else 0]


class ColumnParallelLinear(_Sharded):
    """Y = X·A + b with A = [A_1, …, A_T] split by columns (output features) over the tp ranks.

    Rank i computes Y_i = X·A_i + b_i, its slice of Y's features: nothing is communicated in
    forward. X is replicated (each rank needs all of it), so dL/dX = Σ_i dL/dY_i·A_iᵀ is a sum
    over ranks: `enter` all-reduces it in backward (under sequence parallel X arrives split
    along the sequence, and `enter` all-gathers it, reduce-scattering the gradient). `enter`
    is None where the region was entered before this layer (q, k and v share one entry):
    `reads` is then that entry. Under sequence parallel the layer saves only X's sequence
    slice for backward and gathers it again there (sequence.py).

    `blocks` > 1: a fused projection whose outputs are `blocks` equal parts (q, k, v): each
    part is split separately, so rank i holds [q_i, k_i, v_i]. `valid` < out_features: the
    last columns are vocabulary padding; their outputs are -inf, so a softmax gives them 0.
    `gather`: Y = [Y_1, …, Y_T] all-gathered after the product (what follows needs every
    feature: a norm over the whole q, a fused q/k/v split at fixed offsets); backward keeps
    this rank's slice of Y's gradient, which every rank computed whole.
    """

    float8_split = "output"

    def __init__(self, weight, bias, *, conv1d: bool, full_in: int, full_out: int, rank: int,
                 size: int, enter: Enter | None, blocks: int = 1, valid: int | None = None,
                 reads: Enter | None = None, gather: bool = False):
        super().__init__(weight, bias, conv1d, full_in, full_out, rank, size)
        self.enter, self.blocks, self.gather = enter, blocks, gather
        self.reads = enter if enter is not None else reads
        self.valid = valid if valid is not None and valid < self.out_features else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter is not None:
            x = self.enter(x)
        gathered = self.reads.gathered_slice(x) if self.reads is not None else None
        if gathered is not None:
            y = linear_on_gathered(x, *gathered, self.weight, self.bias, self.conv1d,
                                   self.float8)
        else:
            y = _matmul(x, self.weight, self.bias, self.conv1d, self.float8)
        if self.valid is not None:   # vocabulary padding: never a probability
            y = torch.cat([y[..., :self.valid],
                           y.new_full((*y.shape[:-1], self.out_features - self.valid),
                                      float("-inf"))], dim=-1)
        if self.gather:
            y = gather_from_tp(y, self.enter.comm if self.enter else self.reads.comm, -1,
                               "gather-output")
        return y

    def extra_repr(self) -> str:
        parts = f" in {self.blocks} fused blocks" if self.blocks > 1 else ""
        pad = (f", {self.out_features - self.valid} padding" if self.valid is not None else "")
        gather = ", output all-gathered" if self.gather else ""
        return (f"in_features={self.in_features}, out_features={self.out_features} of "
                f"{self.full_out}{parts}{pad} (tp rank {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}, enter={self.enter!r}{gather}{_float8(self)}")


class RowParallelLinear(_Sharded):
    """Y = X·A + b with A = [A_1; …; A_T] split by rows (input features) over the tp ranks.

    Rank i holds X_i, the slice of the input's features that the column-parallel layer before
    it produced, and computes the partial product X_i·A_i. Y = Σ_i X_i·A_i + b: `exit` sums over
    the ranks (an all-reduce; under sequence parallel a reduce-scatter along the sequence),
    then b is added once. Backward: dL/dX_i = dL/dY·A_iᵀ, no communication.

    `split_input`: X arrives whole (after a column layer that gathered its output), and
    this rank takes its slice X_i itself; backward all-gathers dL/dX_i into dL/dX.
    """

    float8_split = "input"

    def __init__(self, weight, bias, *, conv1d: bool, full_in: int, full_out: int, rank: int,
                 size: int, exit: Exit, split_input: bool = False):
        super().__init__(weight, bias, conv1d, full_in, full_out, rank, size)
        self.exit, self.split_input = exit, split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = scatter_to_tp(x, self.exit.comm, -1, f"{self.exit.tag}:split-input")
        y = self.exit(_matmul(x, self.weight, None, self.conv1d, self.float8))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        split = "input split here, " if self.split_input else ""
        return (f"in_features={self.in_features} of {self.full_in}, out_features="
                f"{self.out_features} (tp rank {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}, {split}exit={self.exit!r}{_float8(self)}")


class VocabParallelEmbedding(nn.Module):
    """E[idx] with the table's rows (the vocabulary) split over the tp ranks: rank i holds
    rows [start, stop) = [i·V'/T, (i+1)·V'/T) of the vocabulary padded to V' (a multiple of T).

    Forward: look up the tokens in this rank's range, zero the others (a masked lookup), and
    `exit` sums over the ranks (all-reduce): every token's row comes from exactly one rank.
    Backward: the gradient reaches only this rank's rows. Padding rows are past the last
    token id, so no lookup ever reaches them: the padding is exact.

    `padding_idx` (the whole vocabulary's, as nn.Embedding's): that row's gradient stays
    zero, on the rank holding it. `embed_scale` (a scaled embedding, Gemma's): the looked-up
    rows are multiplied by it, as the module replaced did.
    """

    def __init__(self, weight, *, vocab: int, start: int, rank: int, size: int, exit: Exit,
                 padding_idx: int | None = None, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = _parameter(weight)
        self.vocab, self.start, self.stop = vocab, start, start + weight.shape[0]
        self.tp_rank, self.tp_size = rank, size
        self.exit = exit
        self.padding_idx = padding_idx
        self.local_padding = (padding_idx - start if padding_idx is not None
                              and start <= padding_idx < self.stop else None)
        if embed_scale is not None:   # non-persistent, as the module replaced kept it
            self.register_buffer("embed_scale", embed_scale, persistent=False)
        else:
            self.embed_scale = None

    @property
    def num_embeddings(self) -> int:
        return self.vocab

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.stop)            # (B, T)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding)       # (B, T, d)
        out = self.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))
        return out * self.embed_scale.to(out.dtype) if self.embed_scale is not None else out

    def extra_repr(self) -> str:
        pad = max(0, self.stop - self.vocab)
        return (f"rows {self.start}..{self.stop - 1} of {self.vocab}"
                + (f" (+{pad} padding)" if pad else "")
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + (", scaled" if self.embed_scale is not None else "")
                + f", embedding_dim={self.embedding_dim} (tp rank {self.tp_rank}/"
                  f"{self.tp_size}), exit={self.exit!r}")
