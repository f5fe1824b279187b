"""PyTorch's own tensor parallel on meshtrain's GPT: DTensor's `parallelize_module` with
ColwiseParallel / RowwiseParallel (and SequenceParallel), the benchmark's other contender.

The plan is torchtitan's for a decoder (its `apply_tp`): the token embedding row-wise (a
vocab-parallel lookup), q, k, v and fc column-wise, the two projections row-wise, the output
layer column-wise with its logits left sharded for `loss_parallel` (torch's vocab-parallel
cross-entropy). With sequence parallel, the LayerNorms run on sequence shards
(SequenceParallel), the attention and MLP inputs are all-gathered (PrepareModuleInput), the
projections reduce-scatter along the sequence, and the embedding's output is split along it.
The GPT's attention computes `q.out_features // head_dim` heads, so q's `out_features` is set
to its local width (torchtitan adjusts its attention's head count the same way).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.core.comm import ring_all_reduce_elements, ring_half_elements


def parallelize_gpt(model, device_mesh, sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = device_mesh.size()
    seq_out = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq_out),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=seq_out),
        "head.lm_head": ColwiseParallel(input_layouts=seq_out, output_layouts=Shard(-1),
                                        use_local_output=False),
    }
    if sequence_parallel:
        plan.update({
            "embed": PrepareModuleOutput(output_layouts=Replicate(),
                                         desired_output_layouts=Shard(1)),
            "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel(),
            "head.ln_f": SequenceParallel(),
            "blocks.*.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),),
                                                use_local_output=True),
            "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
        })
    parallelize_module(model, device_mesh, plan)
    for block in model.blocks:
        block.attn.q.out_features //= tp      # the heads this rank computes
    return model


def train_step(model, optimizer, x, y) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer.zero_grad(set_to_none=True)
    with loss_parallel():
        model.loss(model(x), y).backward()
    optimizer.step()


class CollectiveBytes(TorchDispatchMode):
    """Counts the c10d functional collectives DTensor issues (calls) and charges each the
    bytes a ring sends per rank, exactly as meshtrain's Comm charges its own (core/comm.py)."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank
        self.calls, self.sent = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func._schema.name.partition("::")   # "_c10d_functional::all_reduce"
        if namespace == "_c10d_functional":
            x = args[0]
            if op.startswith("all_reduce"):
                elements = ring_all_reduce_elements(x.numel(), self.world, self.rank)
            elif op.startswith("all_gather"):          # x is this rank's shard
                elements = ring_half_elements(x.numel() * self.world, self.world, self.rank)
            elif op.startswith("reduce_scatter"):      # x is the whole input
                elements = ring_half_elements(x.numel(), self.world, self.rank)
            else:
                elements = None
            if elements is not None:
                self.calls += 1
                self.sent += elements * x.element_size()
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(world: int, rank: int):
    mode = CollectiveBytes(world, rank)
    with mode:
        yield mode
