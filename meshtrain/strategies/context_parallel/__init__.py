"""Context parallel: every sequence split over the cp ranks of the mesh, attention across them.

    check(model, plan)         refusals that need the model but no process group
    apply(model, plan, comm)   the model's attention replaced (ring or all-to-all), its
                               positions made global; returns the ContextSplit that cuts the
                               Trainer's whole sequences into this rank's chunks

Slot 1 after tensor parallel (its attention runs on each tp rank's heads; under sequence
parallel tp splits each cp rank's tokens); pipeline stages pass each cp rank's chunks, and
every cp rank of a stage runs the same schedule, so the ring's exchanges pair up.
Parameters are untouched and replicated over cp, so the gradient sync reduces over dp x cp
(core/mesh.py, [Note: the replica axis]). Each cp rank's loss is the mean over its own
tokens; with equal shares, the mean over dp x cp is the mean over every token of the global
batch (a loss that ignores some tokens would weigh the ranks' shares unequally).
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import Plan
from meshtrain.strategies.context_parallel.layout import ChunkLayout, check_sequence
from meshtrain.strategies.context_parallel.models import check_model, replace_attention

__all__ = ["ContextSplit", "apply", "check", "check_sequence"]


class ContextSplit:
    """Cuts (B, T) whole sequences into this cp rank's (B, T/cp) tokens."""

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout

    def split(self, tensor):
        return self.layout.split(tensor)


def check(model: nn.Module, plan: Plan) -> None:
    if plan.cp > 1:
        check_model(model, plan)


def apply(model: nn.Module, plan: Plan, comm: Comm) -> ContextSplit:
    layout = ChunkLayout(comm.mesh.axis_rank("cp"), comm.mesh.size("cp"))
    replace_attention(model, comm, layout, plan.cp_style)
    return ContextSplit(layout)
