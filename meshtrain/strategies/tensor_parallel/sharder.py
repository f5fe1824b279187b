"""Swapping a model's layers for tensor-parallel ones, in place, from their whole weights.

`Sharder` replaces one named module at a time (nn.Linear, transformers' Conv1D, nn.Embedding)
by the layer of layers.py holding this rank's slice of its weights, under the same attribute
name, so every parameter keeps its name. A weight shared by several modules (tied embedding
and output layer) is sliced once and the slice shared, so the tie holds; sharding it two
different ways is refused. `finish` gives the slot-1 object that knows every split by name.
"""
from __future__ import annotations

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import PlanError
from meshtrain.strategies.tensor_parallel.layers import (ColumnParallelLinear, Enter, Exit,
                                                         RowParallelLinear,
                                                         VocabParallelEmbedding)
from meshtrain.strategies.tensor_parallel.sharding import Split, TensorParallel

AXIS = "tp"


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D: a Linear whose weight is stored (in, out)."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and tuple(module.weight.shape) == (module.nx, module.nf))


def linear_sizes(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if is_conv1d(module) else (w.shape[1], w.shape[0])


def padded(size: int, tp: int) -> int:
    """`size` rounded up to a multiple of tp (the vocabulary's exact padding)."""
    return -(-size // tp) * tp


class Sharder:
    def __init__(self, model: nn.Module, comm: Comm) -> None:
        self.model, self.comm = model, comm
        self.rank, self.size = comm.mesh.axis_rank(AXIS), comm.mesh.size(AXIS)
        # id(whole) -> (whole, its slice, split, name): the whole is held until `finish` so
        # that its id is not reused by a new tensor meanwhile
        self._made: dict[int, tuple[nn.Parameter, nn.Parameter, Split, str]] = {}
        self._split_of: dict[int, Split] = {}                         # id(slice) -> split
        self.vocab_start: int | None = None
        self.vocab: int | None = None

    # ---- the three kinds of layer --------------------------------------------------------
    def column(self, name: str, enter: Enter | None, blocks: int = 1, vocab: bool = False,
               reads: Enter | None = None, gather: bool = False) -> ColumnParallelLinear:
        """Split the output features (`vocab`: they are a vocabulary, padded to a multiple
        of tp, and the layer's outputs are the logits a vocab-parallel loss takes). `reads`:
        the entry, made before this layer, whose output it takes (enter=None). `gather`:
        the outputs are all-gathered whole."""
        old = self.model.get_submodule(name)
        conv1d = is_conv1d(old)
        full_in, full_out = linear_sizes(old)
        split = Split(1 if conv1d else 0, full_out,
                      padded(full_out, self.size) if vocab else full_out, blocks)
        weight = self._slice(name, "weight", old.weight, split)
        bias = (self._slice(name, "bias", old.bias, Split(0, split.full, split.padded, blocks))
                if old.bias is not None else None)
        local_out = split.padded // self.size
        valid = None
        if vocab:
            start = self.rank * local_out
            valid = max(0, min(local_out, full_out - start))
            self._set_output(name, start, full_out)
        new = ColumnParallelLinear(weight, bias, conv1d=conv1d, full_in=full_in,
                                   full_out=full_out, rank=self.rank, size=self.size,
                                   enter=enter, blocks=blocks, valid=valid, reads=reads,
                                   gather=gather)
        return self._swap(name, old, new)

    def row(self, name: str, exit: Exit, split_input: bool = False) -> RowParallelLinear:
        """Split the input features; the bias stays whole (added once, after the sum).
        `split_input`: the input arrives whole and the layer takes its slice."""
        old = self.model.get_submodule(name)
        conv1d = is_conv1d(old)
        full_in, full_out = linear_sizes(old)
        weight = self._slice(name, "weight", old.weight, Split(0 if conv1d else 1, full_in,
                                                               full_in))
        new = RowParallelLinear(weight, old.bias, conv1d=conv1d, full_in=full_in,
                                full_out=full_out, rank=self.rank, size=self.size, exit=exit,
                                split_input=split_input)
        return self._swap(name, old, new)

    def vocab_embedding(self, name: str, exit: Exit) -> VocabParallelEmbedding:
        """Split the rows (the vocabulary, padded to a multiple of tp); its padding row and
        its scale (a scaled embedding's `embed_scale`) kept."""
        old = self.model.get_submodule(name)
        vocab = old.weight.shape[0]
        split = Split(0, vocab, padded(vocab, self.size))
        weight = self._slice(name, "weight", old.weight, split)
        scale = getattr(old, "embed_scale", None)
        new = VocabParallelEmbedding(weight, vocab=vocab, start=self.rank * weight.shape[0],
                                     rank=self.rank, size=self.size, exit=exit,
                                     padding_idx=old.padding_idx,
                                     embed_scale=None if scale is None else
                                     torch.as_tensor(scale, device=weight.device).detach().clone())
        return self._swap(name, old, new)

    def finish(self, partial: set[str] = frozenset()) -> TensorParallel:
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in self._made:
                raise PlanError(f"{n} is the same tensor as {self._made[id(p)][3]} (tied "
                                "weights), which was sharded, but its module is not; shard "
                                "every module that holds it with the same style")
        self._made.clear()   # the whole weights can go now
        splits = {n: self._split_of[id(p)] for n, p in self.model.named_parameters()
                  if id(p) in self._split_of}
        return TensorParallel(self.comm, splits, set(partial), self.vocab_start, self.vocab)

    # ---- mechanics -------------------------------------------------------------------------
    def _slice(self, module: str, attr: str, whole: nn.Parameter, split: Split) -> nn.Parameter:
        made = self._made.get(id(whole))
        if made is not None:
            _, piece, earlier, where = made
            if earlier != split:
                raise PlanError(f"{module}.{attr} is the same tensor as {where} (tied weights) "
                                f"but is sharded differently there ({earlier} vs {split}); give "
                                "both modules the same style in tp_plan (e.g. 'vocab' for a "
                                "tied embedding and output layer)")
            return piece
        piece = nn.Parameter(split.local(whole.detach(), self.rank, self.size),
                             requires_grad=whole.requires_grad)
        self._made[id(whole)] = (whole, piece, split, f"{module}.{attr}")
        self._split_of[id(piece)] = split
        return piece

    def _set_output(self, name: str, start: int, vocab: int) -> None:
        if self.vocab_start is not None:
            raise PlanError(f"{name} is a second vocab-parallel output layer; a model has one "
                            "(the layer whose outputs are the logits)")
        self.vocab_start, self.vocab = start, vocab

    def _swap(self, name: str, old: nn.Module, new: nn.Module):
        parent, _, attr = name.rpartition(".")
        setattr(self.model.get_submodule(parent), attr, new.train(old.training))
        return new
