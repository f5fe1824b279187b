"""Pipeline schedules as data: pure functions from (P ranks, M micro-batches, V chunks per
rank) to each rank's ordered list of actions. One runtime (runtime.py) executes any such
list and one simulator (simulator.py) checks and times it; no schedule has code of its own
beyond the order it produces.

A schedule is built in two passes (torch pipelining's design):
1. `compute_order`: each rank's forwards and backwards, (kind, micro-batch, chunk);
2. `add_communication`: the receive before and the send after each of them, derived from
   where the neighbouring stage lives. The communication is therefore never hand-written.

[Note: stages, chunks and ranks]
The model is cut into S = P*V consecutive stages. Stage s runs on rank s % P as its chunk
s // P (Megatron's interleaved layout: rank r holds stages r, r+P, r+2P, ...), so with V = 1
stage and rank coincide. A message is named by what it carries (activation or gradient),
its micro-batch and the stage that receives it: that name is unique within a step, so sends
and receives match by name, never by position.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from meshtrain.core.plan import SCHEDULES, PlanError




class Kind(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_WEIGHT = "backward_weight"
    """The weight-gradient half of a backward (zero bubble). Where a schedule has one for a
    (micro-batch, chunk), that BACKWARD computes the input gradient only."""
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"


COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT)
SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD)
RECVS = (Kind.RECV_ACT, Kind.RECV_GRAD)
_SHORT = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_WEIGHT: "W",
          Kind.SEND_ACT: "sa", Kind.RECV_ACT: "ra",
          Kind.SEND_GRAD: "sg", Kind.RECV_GRAD: "rg"}


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None
    """The rank at the other end of a send or receive (None for compute)."""

    def __str__(self) -> str:
        text = f"{_SHORT[self.kind]}{self.microbatch}"
        if self.chunk:
            text += f".{self.chunk}"
        return text if self.peer is None else f"{text}@{self.peer}"


@dataclass(frozen=True)
class Message:
    """What one send carries (see [Note: stages, chunks and ranks])."""
    src: int
    dst: int
    grad: bool
    microbatch: int
    stage: int      # the receiving stage


def stage_of(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """The refusals every schedule shares, with a message saying how to fix the plan."""
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if virtual_stages > 1 and schedule != "interleaved":
        raise PlanError(f"virtual_stages={virtual_stages} needs schedule='interleaved' "
                        f"(got {schedule!r}); drop virtual_stages or use the interleaved "
                        "schedule")
    if schedule == "interleaved" and microbatches % pp:
        raise PlanError(f"the interleaved schedule sends micro-batches round the {pp} ranks "
                        f"in groups of {pp}: microbatches={microbatches} must be a multiple "
                        f"of pp={pp} (e.g. {pp * max(1, round(microbatches / pp))})")


# ---- pass 1: forwards and backwards --------------------------------------------------------
def compute_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
                  ) -> list[list[tuple[Kind, int, int]]]:
    """Each rank's forwards and backwards in order: (kind, micro-batch, chunk)."""
    check_schedule(schedule, pp, microbatches, virtual_stages)
    order = {"naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b,
             "interleaved": _interleaved, "zb-h1": _zb_h1}[schedule]
    return [order(rank, pp, microbatches, virtual_stages) for rank in range(pp)]


F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT


def _naive(rank, pp, m, v):
    """Model parallel without pipelining: each micro-batch's forward and backward run
    through every stage (every chunk in order) before the next starts (with M = 1, the
    whole batch)."""
    return [step for i in range(m)
            for step in [(F, i, c) for c in range(v)] + [(B, i, c) for c in reversed(range(v))]]


def _gpipe(rank, pp, m, v):
    """GPipe: every forward, then every backward (activations of all M held at once)."""
    return [(F, i, 0) for i in range(m)] + [(B, i, 0) for i in range(m)]


def _one_f_one_b(rank, pp, m, v):
    """1F1B (PipeDream-flush): P-1-r forwards of warm-up, then one forward one backward,
    then the remaining backwards; rank r holds at most P - r micro-batches."""
    warmup = min(pp - 1 - rank, m)
    order = [(F, i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i, 0), (B, i, 0)]
    return order + [(B, i, 0) for i in range(m - warmup, m)]


def _interleaved(rank, pp, m, v):
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's order): micro-batches go round
    the ranks in groups of P, each group through chunk 0, then chunk 1, ...; backwards
    visit the chunks in reverse. Warm-up: 2(P-1-r) + (V-1)P units (all of them if M = P)."""
    total = m * v

    def unit(k: int, forward: bool) -> tuple[Kind, int, int]:
        chunk = (k // pp) % v
        microbatch = (k // (pp * v)) * pp + k % pp
        return (F, microbatch, chunk) if forward else (B, microbatch, v - 1 - chunk)

    warmup = total if m == pp else min(total, 2 * (pp - 1 - rank) + (v - 1) * pp)
    order = [unit(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, True), unit(k, False)]
    return order + [unit(k, False) for k in range(total - warmup, total)]


def _zb_h1(rank, pp, m, v):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward
    split into B (input gradient, sent upstream at once: the critical path) and W (weight
    gradient, off it). Rank r defers its W's by r places in the steady phase, so that in the
    cool-down the waits for B's are filled with W's. Micro-batches whose activations rank r
    holds (forward done, W not yet): at most (P - 1 - r) + 1 + r = P, the 1F1B peak of
    rank 0."""
    warmup = min(pp - 1 - rank, m)
    order = [(F, i, 0) for i in range(warmup)]
    weights = 0   # W's done so far (in micro-batch order)
    for i in range(m - warmup):
        order += [(F, warmup + i, 0), (B, i, 0)]
        if i + 1 - weights > rank:   # more than r W's pending: do the oldest
            order.append((W, weights, 0))
            weights += 1
    for i in range(m - warmup, m):
        order.append((B, i, 0))
        if i + 1 - weights > rank:
            order.append((W, weights, 0))
            weights += 1
    return order + [(W, i, 0) for i in range(weights, m)]


# ---- pass 2: the sends and receives ----------------------------------------------------------
def add_communication(order: list[tuple[Kind, int, int]], rank: int, pp: int,
                      virtual_stages: int) -> list[Action]:
    """A receive before each forward (backward) whose input comes from the previous (next)
    stage, a send after it to the next (previous) one."""
    last = pp * virtual_stages - 1
    actions = []
    for kind, mb, chunk in order:
        s = stage_of(rank, chunk, pp)
        if kind is F:
            if s > 0:
                actions.append(Action(Kind.RECV_ACT, mb, chunk, (s - 1) % pp))
            actions.append(Action(F, mb, chunk))
            if s < last:
                actions.append(Action(Kind.SEND_ACT, mb, chunk, (s + 1) % pp))
        elif kind is W:   # local work: nothing to send or receive
            actions.append(Action(W, mb, chunk))
        else:
            if s < last:
                actions.append(Action(Kind.RECV_GRAD, mb, chunk, (s + 1) % pp))
            actions.append(Action(B, mb, chunk))
            if s > 0:
                actions.append(Action(Kind.SEND_GRAD, mb, chunk, (s - 1) % pp))
    return actions


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
                   ) -> list[list[Action]]:
    """Every rank's complete action list for one training step."""
    orders = compute_order(schedule, pp, microbatches, virtual_stages)
    return [add_communication(o, r, pp, virtual_stages) for r, o in enumerate(orders)]


def evaluation_schedule(pp: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Evaluation: the whole batch forward through every stage, no backward."""
    return [forward_only(add_communication(_naive(r, pp, 1, virtual_stages), r, pp,
                                           virtual_stages)) for r in range(pp)]


def forward_only(actions: list[Action]) -> list[Action]:
    """The same list without backward work: evaluation runs the forwards alone."""
    return [a for a in actions if a.kind in (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)]


def message(action: Action, rank: int, pp: int) -> Message:
    """The message a send or receive on `rank` refers to."""
    s = stage_of(rank, action.chunk, pp)
    if action.kind is Kind.SEND_ACT:
        return Message(rank, action.peer, False, action.microbatch, s + 1)
    if action.kind is Kind.RECV_ACT:
        return Message(action.peer, rank, False, action.microbatch, s)
    if action.kind is Kind.SEND_GRAD:
        return Message(rank, action.peer, True, action.microbatch, s - 1)
    if action.kind is Kind.RECV_GRAD:
        return Message(action.peer, rank, True, action.microbatch, s)
    raise ValueError(f"{action} is not communication")


def message_tag(msg: Message, stages: int) -> int:
    """A c10d tag unique to `msg` within a step, so receives match sends by name."""
    return (msg.microbatch * stages + msg.stage) * 2 + int(msg.grad)


def bubble_formula(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   forward_cost: float = 1.0, backward_cost: float = 1.0,
                   weight_cost: float | None = None) -> tuple[float, str]:
    """The idle fraction theory gives with equal stage costs, and the formula as text.
    Only zb-h1's depends on the costs: F, B (input gradient) = backward - W, and W (weight
    gradient, half the backward if not given), as the simulator takes them."""
    p, m, v = pp, microbatches, virtual_stages
    if schedule == "zb-h1":
        # Qi et al. 2023, table 1: each rank idles (P-1)(F+B-W) where 1F1B idles
        # (P-1)(F+B+W), a third of it when F = B = W: (P-1)/(3M+P-1). Exact for M >= P
        # and W <= B (the simulator agrees; a larger W cannot all hide in the cool-down).
        w = backward_cost / 2 if weight_cost is None else weight_cost
        f, b = forward_cost, backward_cost - w
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle), "(P-1)(F+B-W)/(M(F+B+W)+(P-1)(F+B-W))"
    if schedule == "naive":
        return (p - 1) / p, "(P-1)/P"
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1), "(P-1)/(V*M+P-1)"
    return (p - 1) / (m + p - 1), "(P-1)/(M+P-1)"
