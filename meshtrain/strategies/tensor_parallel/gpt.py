"""Tensor parallel for meshtrain's GPT, natively: `Plan(tp=T[, sequence_parallel=True])`.

Per block (Megatron 2019 §3, Figure 3), x (B, S, h):
    attention   enter → q, k, v column-parallel (each rank: n_head/T whole heads) →
                attention on those heads → proj row-parallel → exit
    MLP         enter → fc column-parallel (4h/T) → gelu → proj row-parallel → exit
    MoE MLP     the router and the experts whole on every rank, as for a transformers
                mixture (models/hf_plans.py): each tp rank routes the same whole tokens
                (split over ep ranks where Plan.ep > 1); sequence parallel is refused
`enter` is one all-reduce in backward (q, k and v share it: a pre-hook on the attention
module), `exit` one all-reduce in forward: 2 all-reduces of B·S·h elements forward and 2
backward per block. The token embedding is vocab-parallel (one all-reduce forward), the
output layer column-parallel over the vocabulary, feeding the vocab-parallel loss (its
input's `enter`: one all-reduce backward).

Sequence parallel (Korthikanti et al. 2022 §4.2.2): between the regions above, the residual
stream and the LayerNorms hold only S/T of the sequence (dim 1) on each rank. `enter`
becomes an all-gather along the sequence (reduce-scatter in backward), `exit` a
reduce-scatter (all-gather in backward): the same bytes as the all-reduces they replace.
The column-parallel layers save only their input's sequence slice and all-gather it again
in backward (Megatron-LM; sequence.py): one more all-gather per region and micro-batch, and
each layer keeps Korthikanti's 34/t (Table 2) in place of 4 more whole activations.
The embedding's output is split along the sequence (the position embedding is learned, so
this is Megatron's order: all-reduce, add positions, split; the split's backward is an
all-gather). The LayerNorms' parameters and the row-parallel biases then see only S/T of the
tokens, so their gradients are summed over tp after the dp sync (`partial`).
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import PlanError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.strategies.tensor_parallel.communications import scatter_to_tp
from meshtrain.strategies.tensor_parallel.layers import Enter, Exit
from meshtrain.strategies.tensor_parallel.sharder import Sharder
from meshtrain.strategies.tensor_parallel.sharding import TensorParallel

SEQUENCE_DIM = 1   # activations are (B, S, h)


def check_gpt(config: GPTConfig, tp: int) -> None:
    """Refuse a tp that does not split the GPT's heads or MLP width into whole parts."""
    if config.n_head % tp:
        raise PlanError(f"tp={tp} does not divide the GPT's n_head={config.n_head} attention "
                        f"heads: each rank computes whole heads; choose tp among "
                        f"{_divisors(config.n_head)} or a model whose n_head is a multiple "
                        f"of {tp}")
    hidden = config.mlp_ratio * config.d_model
    if hidden % tp and not config.experts:   # experts stay whole over tp
        raise PlanError(f"tp={tp} does not divide the GPT's MLP width {hidden} (blocks.*.mlp.fc "
                        f"out_features); choose tp among {_divisors(hidden)}")


def check_tensor_parallel(config: GPTConfig, plan) -> None:
    """The GPT's refusals from its config alone (the CLI runs them before any rank starts)."""
    if plan.tp > 1:
        check_gpt(config, plan.tp)
    if plan.sequence_parallel:
        check_sequence(config.seq_len, plan.tp)


def check_sequence(length: int, tp: int) -> None:
    if length % tp:
        raise ValueError(f"sequence parallel splits each sequence over tp={tp} ranks, but this "
                         f"batch's sequences have {length} tokens; use a sequence length that "
                         f"is a multiple of {tp}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class EnterRegion:
    """Forward pre-hook: the module's input enters the tensor-parallel region."""

    def __init__(self, enter: Enter) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (self.enter(args[0]), *args[1:])


class SplitSequence:
    """Forward hook on the embedding: keep this rank's S/T tokens of each sequence (split
    forward, all-gather backward)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, module: nn.Module, args: tuple, out):
        check_sequence(out.size(SEQUENCE_DIM), self.comm.mesh.size("tp"))
        return scatter_to_tp(out, self.comm, SEQUENCE_DIM, "embed")   # (B, S/T, h)


def shard_gpt(model: GPT, comm: Comm, sequence_parallel: bool) -> TensorParallel:
    """Swap the GPT's layers for tensor-parallel ones in place; returns slot 1's object."""
    check_gpt(model.config, comm.mesh.size("tp"))
    seq = SEQUENCE_DIM if sequence_parallel else None
    sharder = Sharder(model, comm)
    sharder.vocab_embedding("embed.tok", Exit(comm, "embed.tok"))
    if sequence_parallel:
        model.embed.register_forward_hook(SplitSequence(comm))
    partial: set[str] = set()
    for i, block in enumerate(model.blocks):
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        enter = Enter(comm, attn, seq)
        block.attn.register_forward_pre_hook(EnterRegion(enter))
        for proj in ("q", "k", "v"):
            sharder.column(f"{attn}.{proj}", enter=None, reads=enter)
        sharder.row(f"{attn}.proj", Exit(comm, attn, seq))
        if model.config.experts:   # router and experts whole on every tp rank
            continue
        sharder.column(f"{mlp}.fc", Enter(comm, mlp, seq))
        sharder.row(f"{mlp}.proj", Exit(comm, mlp, seq))
    sharder.column("head.lm_head", Enter(comm, "head.lm_head", seq), vocab=True)
    if sequence_parallel:   # what sees only S/T tokens: LayerNorms, biases added after a sum
        partial = {f"{m}.{p}" for m, module in model.named_modules()
                   if isinstance(module, nn.LayerNorm) for p, _ in module.named_parameters()}
        partial |= {f"blocks.{i}.{proj}.bias" for i, block in enumerate(model.blocks)
                    for proj in ("attn.proj", "mlp.proj")
                    if block.get_submodule(proj).bias is not None}
    return sharder.finish(partial)
