"""Run every rank's action list against the others in one process, with no tensors: find
deadlocks and unmatched messages, and time the schedule for given forward/backward costs.

The model of execution is the runtime's: a send never blocks (it is posted and waited at
the end of the step), a receive blocks until its message has been sent, compute takes its
cost (a chunk is 1/V of a stage, so it costs 1/V of the stage's forward or backward), and
communication takes no time. The bubble is the idle fraction of P ranks over the makespan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.strategies.pipeline.schedules import (COMPUTE, RECVS, SENDS, Action, Kind,
                                                     message)


class ScheduleError(RuntimeError):
    """A schedule that cannot run: the message shows the step x rank grid, failing step marked."""


@dataclass
class Block:
    """One forward or backward on the timeline."""
    rank: int
    kind: Kind
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class Timeline:
    blocks: list[Block]
    ranks: int
    makespan: float
    busy: list[float] = field(default_factory=list)
    origin: float = 0.0
    """A measured trace's start on time.perf_counter (the same clock for local ranks)."""
    waits: list[Block] = field(default_factory=list)
    """A measured trace's communication: each run of sends and receives, posted and
    waited for (its kind and micro-batch are the run's first action's)."""

    @property
    def bubble(self) -> float:
        """Idle time of all ranks over the makespan, as a fraction of ranks x makespan."""
        return 1.0 - sum(self.busy) / (self.ranks * self.makespan)


def check_actions(actions: list[list[Action]]) -> None:
    """Per rank: each (micro-batch, chunk) forward once and backward once at most, and
    never a backward before its forward (nor a weight gradient before its backward)."""
    for rank, acts in enumerate(actions):
        seen_f, seen_b, seen_w = set(), set(), set()
        for i, a in enumerate(acts):
            key = (a.microbatch, a.chunk)
            if a.kind is Kind.FORWARD:
                if key in seen_f:
                    raise ScheduleError(_grid(actions, {rank: i}, f"rank {rank}: second forward "
                                                                  f"of {key}"))
                seen_f.add(key)
            elif a.kind is Kind.BACKWARD:
                if key not in seen_f or key in seen_b:
                    raise ScheduleError(_grid(actions, {rank: i}, f"rank {rank}: backward of "
                                                                  f"{key} before its forward "
                                                                  "or twice"))
                seen_b.add(key)
            elif a.kind is Kind.BACKWARD_WEIGHT:
                if key not in seen_b or key in seen_w:
                    raise ScheduleError(_grid(actions, {rank: i}, f"rank {rank}: weight "
                                                                  f"gradient of {key} before "
                                                                  "its backward or twice"))
                seen_w.add(key)


def simulate(actions: list[list[Action]], forward_cost: float = 1.0,
             backward_cost: float = 1.0, virtual_stages: int = 1,
             weight_cost: float | None = None, message_cost: float = 0.0,
             host_cost: float = 0.0) -> Timeline:
    """Execute the lists against each other; raise ScheduleError on a deadlock or a
    message sent twice or never received. `weight_cost` is the part of `backward_cost`
    that is the weight gradient (half of it if not given): a BACKWARD split from its
    BACKWARD_WEIGHT costs the rest. Theory counts communication and the host's work as
    free; `message_cost` delays each receive after its send, and `host_cost` idles a rank
    after each compute block (neither counts as busy)."""
    check_actions(actions)
    pp = len(actions)
    weight = backward_cost / 2 if weight_cost is None else weight_cost
    cost = {Kind.FORWARD: forward_cost / virtual_stages,
            Kind.BACKWARD: backward_cost / virtual_stages,
            Kind.BACKWARD_WEIGHT: weight / virtual_stages}
    split = [{(a.microbatch, a.chunk) for a in acts if a.kind is Kind.BACKWARD_WEIGHT}
             for acts in actions]
    pc, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    sent: dict = {}       # message -> time it was sent
    blocks: list[Block] = []
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while pc[rank] < len(actions[rank]):
                a = actions[rank][pc[rank]]
                if a.kind in SENDS:
                    msg = message(a, rank, pp)
                    if msg in sent:
                        raise ScheduleError(_grid(actions, {rank: pc[rank]},
                                                  f"rank {rank} sends {msg} twice"))
                    sent[msg] = clock[rank]
                elif a.kind in RECVS:
                    msg = message(a, rank, pp)
                    if msg not in sent:
                        break   # blocked until the peer sends it
                    clock[rank] = max(clock[rank], sent.pop(msg) + message_cost)
                elif a.kind in COMPUTE:
                    start, took = clock[rank], cost[a.kind]
                    if a.kind is Kind.BACKWARD and (a.microbatch, a.chunk) in split[rank]:
                        took -= cost[Kind.BACKWARD_WEIGHT]   # the input gradient only
                    clock[rank] += took
                    busy[rank] += took
                    blocks.append(Block(rank, a.kind, a.microbatch, a.chunk, start, clock[rank]))
                    clock[rank] += host_cost
                pc[rank] += 1
                progress = True
    blocked = {r: pc[r] for r in range(pp) if pc[r] < len(actions[r])}
    if blocked:
        waits = "; ".join(f"rank {r} waits in {actions[r][i]}" for r, i in blocked.items())
        raise ScheduleError(_grid(actions, blocked, f"deadlock: {waits}"))
    if sent:
        raise ScheduleError(_grid(actions, {}, "sent but never received: "
                                  + ", ".join(map(str, sent))))
    # the makespan ends with the last compute, as a measured one does
    return Timeline(blocks, pp, max((b.end for b in blocks), default=0.0), busy)


def _grid(actions: list[list[Action]], marked: dict[int, int], why: str) -> str:
    """The step x rank grid, the failing step of each rank in `marked` between >> <<."""
    rows = [why, "step  " + "".join(f"rank {r:<8}" for r in range(len(actions)))]
    for i in range(max(len(a) for a in actions)):
        cells = []
        for r, acts in enumerate(actions):
            text = str(acts[i]) if i < len(acts) else ""
            cells.append(f"{'>>' + text + '<<' if marked.get(r) == i else text:<13}")
        rows.append(f"{i:<6}" + "".join(cells))
    return "\n".join(rows)
