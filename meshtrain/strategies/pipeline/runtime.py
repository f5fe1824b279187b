"""Slot 5 for pp > 1: one executor that runs any schedule's action list (schedules.py) on
this rank's stages. No schedule has a loop of its own here: the list is the program.

    forward   stage 0 reads its micro-batch, the others the activation received; the last
              stage computes the loss (divided by M, so the micro-batches average)
    backward  from the loss, or from the gradient received for the stage's output; the
              input's gradient is what the previous stage receives; the micro-batch's
              activations are dropped at once
    send/recv consecutive communication actions are posted together, their sends and
              their receives as ONE batch of isend/irecv (as torch's pipelining does: two
              neighbours posting sends before receives deadlock on NCCL once a message
              exceeds its buffering), through the accounted Comm (axis "pp", tags "act"
              and "grad"); receives are waited for at once, sends only when their buffer
              is needed no more
    trace     each forward, backward and weight gradient is timed, and each run of
              communication apart, on the device's timeline (CUDA events; the host
              clock on CPU): `trace` is this rank's measured timeline

Gradient sync over dp (slot 3) is driven as the micro-batch loop drives it: every backward
but this rank's last runs inside `no_sync`, so the dp reduction starts during the last
backward and overlaps the cool-down; the Trainer calls `finish_gradient_sync` after `run`.
Under zero bubble (a BACKWARD followed later by its BACKWARD_WEIGHT) the B computes the input
gradient only (torch.autograd.grad, nothing accumulates, no hook fires) and the W the weight
gradients (torch.autograd.backward on the graph B kept): W is what `no_sync` wraps, and the
rank's last W is where the dp reduction starts.

[Note: receiving ahead]
On gloo a message moves only once its receive is posted (the receiver tells the sender
where to write), so a receive posted as the schedule reaches it waits for that round trip
besides the data. On CPU, as soon as a run of communication is done, the next run's
receives are posted (where their buffers can be sized): the data lands while this rank
computes. Messages match by tag there. NCCL ignores tags and runs one peer pair's sends
and receives in order on one stream, so a receive moved ahead of a send to the same peer
could deadlock: on CUDA the receives stay where the schedule puts them.

[Note: activation shapes]
A receiver must size its buffer before the data arrives. Every rank is given the same
batch, so both ends of a boundary know the micro-batch's input shape; the first time an
input shape meets a boundary, the sender sends the activation's shapes and dtypes ahead of
it (tag "shape"), and both ends remember them. A gradient has its activation's shape, which
its receiver sent itself. A boundary carries one tensor or a tuple (boundary.py): each
tensor of a message is its own send and receive, tagged apart.
"""
from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from typing import Callable

import torch

from meshtrain.core.comm import P2P, Comm
from meshtrain.core.device import Stopwatch, to_device
from meshtrain.core.memory import ActivationMeter
from meshtrain.core.plan import Plan
from meshtrain.strategies.pipeline import boundary, zero_bubble
from meshtrain.strategies.pipeline.schedules import (COMPUTE, RECVS, Action, Kind,
                                                     build_schedule, evaluation_schedule,
                                                     message, message_tag, stage_of)
from meshtrain.strategies.pipeline.simulator import Block, Timeline
from meshtrain.strategies.pipeline.stages import PipelineStages
from meshtrain.strategies.slots import GradientSync, split_microbatches

_SHAPE, _PART = 1 << 24, 1 << 26   # tag offsets: a shape header, tensor i of a message


class PipelineError(RuntimeError):
    """A pipeline step that could not go on (a neighbouring stage failed or hung)."""


class PipelineSchedule:
    """StepDriver protocol (strategies/slots.py) over a schedule's action list."""

    def __init__(self, stages: PipelineStages, plan: Plan, comm: Comm, loss_fn: Callable,
                 activations: ActivationMeter | None = None,
                 recv_timeout: float | None = None) -> None:
        self.stages, self.comm, self.loss_fn = stages, comm, loss_fn
        self.activations = activations
        self.pp, self.rank, self.microbatches = plan.pp, stages.rank, plan.microbatches
        self.actions = build_schedule(plan.schedule, plan.pp, plan.microbatches,
                                      plan.virtual_stages)[self.rank]
        self.eval_actions = evaluation_schedule(plan.pp, plan.virtual_stages)[self.rank]
        self.recv_timeout = recv_timeout
        """Seconds a receive may wait (None: the process group's timeout)."""
        self.receive_ahead = comm.mesh.device.type == "cpu"
        """Post the next run's receives as soon as this run is done: see [Note: receiving
        ahead]."""
        self.shapes: dict[tuple, boundary.Shapes] = {}
        """(receiving stage, micro-batch input shape) -> the activation's shapes and dtypes:
        see [Note: activation shapes]."""
        self._marks = None   # the last step's Stopwatch and marks, read by `trace`
        self._trace: Timeline | None = None
        self.peak_held = 0
        """The most micro-batches (x chunks) whose activations this rank held at once in
        the last step: the runtime's own accounting of activation memory. With an
        ActivationMeter, its `last_bytes` becomes the bytes held at that peak."""
        self.received_ahead = 0
        """How many receives the last step posted ahead of their place in the schedule."""

    @property
    def trace(self) -> Timeline | None:
        """This rank's forwards and backwards in the last step, timed on the device's own
        timeline (seconds from the step's start): `trace.bubble` is the fraction of the step
        this rank was idle. Read when asked: on CUDA the events are waited for only then."""
        if self._trace is None and self._marks is not None:
            clock, blocks, waits, end = self._marks
            timed = [[Block(self.rank, kind, mb, chunk, clock.seconds(b), clock.seconds(e))
                      for kind, mb, chunk, b, e in marks] for marks in (blocks, waits)]
            self._trace = Timeline(timed[0], 1, clock.seconds(end),
                                   [sum(b.end - b.start for b in timed[0])], clock.origin,
                                   timed[1])
        return self._trace

    # ---- StepDriver ----------------------------------------------------------------------
    def run(self, inputs: torch.Tensor, targets: torch.Tensor,
            sync: GradientSync) -> torch.Tensor:
        return self._execute(self.actions, inputs, targets, self.microbatches, sync)

    def global_loss(self, dp_mean: float) -> float:
        """Only the last stage computed a loss: every rank takes its value."""
        loss = torch.tensor(dp_mean, dtype=torch.float64, device=self.comm.mesh.device)
        self.comm.broadcast(loss, self.pp - 1, "pp", tag="loss")
        return loss.item()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self._execute(self.eval_actions, inputs, targets, 1, None)
        return self.global_loss(loss.item())

    # ---- the executor -----------------------------------------------------------------------
    def _execute(self, actions: list[Action], inputs, targets, microbatches: int,
                 sync: GradientSync | None) -> torch.Tensor:
        step = _Step(self, split_microbatches(inputs, microbatches),
                     split_microbatches(targets, microbatches), sync)
        split = {(a.microbatch, a.chunk) for a in actions if a.kind is Kind.BACKWARD_WEIGHT}
        step.split = split
        # the last action that accumulates weight gradients: the dp sync starts in it; and
        # each chunk's last, after which its gradients are final
        accumulating = {i: a.chunk for i, a in enumerate(actions)
                        if a.kind is Kind.BACKWARD_WEIGHT or
                        (a.kind is Kind.BACKWARD and (a.microbatch, a.chunk) not in split)}
        last_backward = max(accumulating, default=-1)
        chunk_ends = {max(i for i, c in accumulating.items() if c == chunk)
                      for chunk in set(accumulating.values())} - {last_backward}
        clock = Stopwatch(self.comm.mesh.device)
        blocks, waits = [], []   # (kind, micro-batch, chunk, begin mark, end mark)
        if sync is not None:   # a training step is traced (on CUDA: one synchronisation)
            clock.start()
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.kind in COMPUTE:
                begin = clock.mark()
                step.compute(a, final=i == last_backward)
                if i in chunk_ends:   # this chunk's gradients are final
                    step.sync.backward_done(step.chunk_params[a.chunk])
                blocks.append((a.kind, a.microbatch, a.chunk, begin, clock.mark()))
                i += 1
                continue
            j = i
            while j < len(actions) and actions[j].kind not in COMPUTE:
                j += 1
            begin = clock.mark()
            step.communicate(actions[i:j])
            if self.receive_ahead:
                step.receive_ahead(_next_run(actions, j))
            waits.append((actions[i].kind, actions[i].microbatch, actions[i].chunk, begin,
                          clock.mark()))
            i = j
        step.finish()
        if sync is not None:   # a training step, not an evaluation
            self._marks = (clock, blocks, waits, clock.mark())
            self._trace = None
            self.peak_held, self.received_ahead = step.peak_held, step.received_ahead
            if self.activations is not None:
                self.activations.last_bytes = step.peak_bytes
        return step.loss_sum


class _Step:
    """What one step holds: micro-batches, activations awaiting backward, messages."""

    def __init__(self, driver: PipelineSchedule, xs, ys, sync) -> None:
        self.d, self.xs, self.ys, self.sync = driver, xs, ys, sync
        self.device = driver.comm.mesh.device
        self.last_stage = driver.stages.stages - 1
        self.held: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (input, output, captured)
        self.split: set[tuple[int, int]] = set()  # (mb, chunk) whose backward is B then W
        # each chunk's parameters, where a rank holds several: what its backward reaches
        chunks = driver.stages.chunks
        self.chunk_params = [list(c.parameters()) for c in chunks] if len(chunks) > 1 else []
        self.inbox: dict[tuple[bool, int, int], torch.Tensor] = {}   # received
        self.outbox: dict[tuple[bool, int, int], torch.Tensor] = {}  # to send
        self.sending: list = []                            # (work, tensor) in flight
        self.ahead: dict[tuple[bool, int, int], tuple] = {}  # posted early: (value, works)
        self.loss_sum = torch.zeros((), device=self.device)
        self.held_bytes: dict[tuple[int, int], int] = {}  # what autograd saved, per entry
        self.weight_work: dict[tuple[int, int], list] = {}  # after B: what W needs
        self.peak_held = self.peak_bytes = self.received_ahead = 0

    def stage(self, a: Action) -> int:
        return stage_of(self.d.rank, a.chunk, self.d.pp)

    # ---- compute ----------------------------------------------------------------------------
    def compute(self, a: Action, final: bool) -> None:
        key, s = (a.microbatch, a.chunk), self.stage(a)
        if a.kind is Kind.FORWARD:
            if s == 0:
                x = to_device(self.xs[a.microbatch], self.device)
            else:
                x = self.inbox.pop((False, *key))
                boundary.mark_inputs(x)
            meter = self.d.activations if torch.is_grad_enabled() else None
            chunk, captured = self.d.stages.chunks[a.chunk], None
            with (meter.measure() if meter is not None else nullcontext()):
                if key in self.split and torch.is_grad_enabled():
                    y, captured = zero_bubble.forward_split(chunk, x)
                else:
                    y = chunk(x)
                if s == self.last_stage:
                    target = to_device(self.ys[a.microbatch], self.device)
                    y = self.d.loss_fn(y, target) / len(self.xs)
            if s == self.last_stage:
                self.loss_sum += y.detach()
            elif (problem := boundary.problem(y, s)) is not None:
                raise PipelineError(problem)
            else:
                self.outbox[(False, *key)] = boundary.detached(y)
            if torch.is_grad_enabled():
                self.held[key] = (x, y, captured)
                self.held_bytes[key] = meter.last_bytes if meter is not None else 0
                self.peak_held = max(self.peak_held, len(self.held))
                self.peak_bytes = max(self.peak_bytes, sum(self.held_bytes.values()))
            return
        if a.kind is Kind.BACKWARD_WEIGHT:
            self.held.pop(key)   # W is the last use of the micro-batch's activations
            self.held_bytes.pop(key)
            with self._synced(a, final):
                zero_bubble.weight_gradients(self.weight_work.pop(key))
            return
        grad = None if s == self.last_stage else self.inbox.pop((True, *key))
        if key in self.split:   # B: the input gradient only, the graph kept for W
            x, y, captured = self.held[key]
            grad_x, self.weight_work[key] = zero_bubble.input_gradients(y, x, captured, grad)
            if s > 0:
                self.outbox[(True, *key)] = grad_x
            return
        x, y, _ = self.held.pop(key)   # dropped after this backward: see the module docstring
        self.held_bytes.pop(key)
        with self._synced(a, final):
            boundary.backward(y, grad)
        if s > 0:
            self.outbox[(True, *key)] = boundary.input_gradients(x)

    def _synced(self, a: Action, final: bool):
        """The dp sync around the backward that fills chunk `a.chunk`'s weight gradients:
        `no_sync` but for this rank's last, told which chunk it reaches where a rank holds
        several (ZeRO-2 then reduces that chunk's buckets only)."""
        if self.sync is None:
            return nullcontext()
        if self.chunk_params:
            self.sync.backward_reaches(self.chunk_params[a.chunk])
        return nullcontext() if final else self.sync.no_sync()

    # ---- communication -------------------------------------------------------------------------
    def communicate(self, actions: list[Action]) -> None:
        """Post a run's sends and receives as one batch of isend/irecv; wait for the
        receives. A run that must first learn a shape (see [Note: activation shapes]; the
        first step only) posts its sends before it waits for that header, as the peer may
        wait for one of these sends before it sends the header."""
        self._reap_sends()
        sends, recvs, early = [], [], []   # (action, key, match, value)
        for a in actions:
            grad = a.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
            key = (grad, a.microbatch, a.chunk)
            match = message_tag(message(a, self.d.rank, self.d.pp), self.last_stage + 1)
            if key in self.ahead:
                early.append((a, key))
            elif a.kind in RECVS:
                recvs.append((a, key, match))
            else:
                value = self.outbox.pop(key)
                if not grad:
                    self._send_shape(a, value, match)
                sends.append((a, key, match, value))
        ops = _parts(sends, send=True)
        learns_shape = any(not key[0] and self._shape_key(a, self.stage(a)) not in self.d.shapes
                           for a, key, _ in recvs)
        works = self.d.comm.batch_isend_irecv(ops, "pp") if learns_shape else []
        recvs = [(a, key, m, self._receive_buffer(a, key, m)) for a, key, m in recvs]
        received = _parts(recvs, send=False)
        works += self.d.comm.batch_isend_irecv(received if learns_shape else ops + received,
                                               "pp")
        for op, work in zip(ops, works):
            self.sending.append((work, op.tensor))
        waits = iter(works[len(ops):])
        for a, key, _, value in recvs:
            for _ in boundary.tensors(value):
                self._wait(next(waits), a)
            self.inbox[key] = value
        for a, key in early:
            value, posted = self.ahead.pop(key)
            for work in posted:
                self._wait(work, a)
            self.inbox[key] = value

    def receive_ahead(self, actions: list[Action]) -> None:
        """Post the receives of `actions` (the next run) whose buffers can be sized now: a
        gradient whose forward ran, an activation whose shape is known."""
        ready = []
        for a in actions:
            grad = a.kind is Kind.RECV_GRAD
            key = (grad, a.microbatch, a.chunk)
            if a.kind not in RECVS or key in self.ahead or (
                    key[1:] not in self.held if grad
                    else self._shape_key(a, self.stage(a)) not in self.d.shapes):
                continue
            match = message_tag(message(a, self.d.rank, self.d.pp), self.last_stage + 1)
            ready.append((a, key, match, self._receive_buffer(a, key, match)))
        self.received_ahead += len(ready)
        works = iter(self.d.comm.batch_isend_irecv(_parts(ready, send=False), "pp"))
        for a, key, _, value in ready:
            self.ahead[key] = (value, [next(works) for _ in boundary.tensors(value)])

    def _shape_key(self, a: Action, stage: int) -> tuple:
        return (stage, tuple(self.xs[a.microbatch].shape))

    def _send_shape(self, a: Action, value, match: int) -> None:
        key = self._shape_key(a, self.stage(a) + 1)
        if key in self.d.shapes:
            return
        header = boundary.header(value, self.device)
        work, = self.d.comm.batch_isend_irecv([P2P(header, a.peer, True, match + _SHAPE)],
                                              "pp", tag="shape")
        self.sending.append((work, header))
        self.d.shapes[key] = boundary.shapes_of(value)

    def _receive_buffer(self, a: Action, key, match: int):
        if key[0]:   # a gradient: shaped as the output it belongs to
            return boundary.empty_like(self.held[key[1:]][1])
        shape_key = self._shape_key(a, self.stage(a))
        if shape_key not in self.d.shapes:
            header = boundary.empty_header(self.device)
            work, = self.d.comm.batch_isend_irecv([P2P(header, a.peer, False, match + _SHAPE)],
                                                  "pp", tag="shape")
            self._wait(work, a)
            self.d.shapes[shape_key] = boundary.read_header(header)
        return boundary.empty(self.d.shapes[shape_key], self.device)

    def _wait(self, work, a: Action) -> None:
        try:
            if self.d.recv_timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.d.recv_timeout))
        except RuntimeError as exc:
            raise PipelineError(f"pp rank {self.d.rank}: {a.kind.value} of micro-batch "
                                f"{a.microbatch} (chunk {a.chunk}) from pp rank {a.peer} "
                                f"failed; that stage failed or hung: {exc}") from exc

    def _reap_sends(self) -> None:
        self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]

    def finish(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()
        if self.held or self.inbox or self.outbox or self.ahead:
            raise PipelineError(f"pp rank {self.d.rank}: the schedule left work undone "
                                f"(held {sorted(self.held)}, received {sorted(self.inbox)}, "
                                f"unsent {sorted(self.outbox)})")


def _next_run(actions: list[Action], start: int) -> list[Action]:
    """The run of communication actions that follows the compute after `start`."""
    i = start
    while i < len(actions) and actions[i].kind in COMPUTE:
        i += 1
    j = i
    while j < len(actions) and actions[j].kind not in COMPUTE:
        j += 1
    return actions[i:j]


def _parts(messages: list, send: bool) -> list[P2P]:
    """One P2P per tensor of each (action, key, match, value): tensor i of a message is
    tagged match + i * _PART."""
    return [P2P(t.contiguous() if send else t, a.peer, send=send, match=m + i * _PART,
                tag="grad" if key[0] else "act")
            for a, key, m, value in messages for i, t in enumerate(boundary.tensors(value))]
