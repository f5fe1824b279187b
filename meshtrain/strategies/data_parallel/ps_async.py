"""Parameter server, asynchronous with bounded staleness (`dp_mode="ps-async", staleness=s`).

The layout and the optimizer are ps-sync's (parameter_server.py); what changes is when
things happen. No worker waits for all the others:

    push   a worker sends its gradient with (its step, the version it computed on, its
           loss), then waits only for a version of each shard newer than the one it used
    serve  a server adds each push as it arrives and applies what it holds as one update as
           soon as no worker still computing would be applied more than s versions stale
           (ps_server.py, [Note: versions and staleness]); each new version goes to every
           worker
    pull   a worker takes every version its servers send, keeping the newest

So a fast worker is never more than s versions ahead of the slowest, every applied gradient
is at most s versions stale (each server records every push's staleness), and s = 0 is the
synchronous schedule exactly. With s > 0 the fast workers' pushes are applied while a
straggler computes: they complete more pushes than it does.

[Note: mailboxes]
gloo's point-to-point receives cannot be polled (a posted receive reports completion only
once waited on, measured on torch 2.13), so each stream a rank receives (pushes from each
worker, versions from each server) has a mailbox: a thread that waits on one receive after
another and queues what arrives. The rank's own thread takes from the queue whenever its
worker waits (at the end of each step, while a straggler is delayed in `idle`, in `settle`),
serving its shard and taking new versions; compute never waits on a peer's messages.
Pushes and versions travel on channels of their own (c10d tags), so that two ranks that are
each other's server and worker never match one stream's message to the other's receive.
`settle` drains everything before a collective (evaluation, checkpoints): each worker sends
a DONE message to every server, each server answers DONE after its last update, and every
mailbox thread ends on its DONE. A peer silent for `timeout_s`, or whose connection fails,
is named by rank and this rank stops.

The step returns the mean loss of the pushes in the newest update of shard 0 (with s = 0,
the global loss of the step just taken). Workers may run different numbers of steps (a
time budget): `settle` waits for every worker's DONE.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from meshtrain.strategies.shared.buckets import Bucket
from meshtrain.strategies.data_parallel.parameter_server import (AXIS, ParameterServer,
                                                                 PeerLost, lost)

DONE = -1.0        # the step (push) or version (pull) field of a closing message
HEADER = 3         # push: step, computed-on version, loss; pull: version, loss, unused
PUSH, PULL = 1, 2  # the c10d channels of the two streams


class Mailbox:
    """Receives one peer's stream on a thread of its own (see [Note: mailboxes]) into a
    shared queue of (channel, peer, message or exception); ends after the DONE message."""

    def __init__(self, comm, peer: int, channel: int, message, inbox: queue.Queue) -> None:
        self.comm, self.peer, self.channel = comm, peer, channel
        self.message, self.inbox = message, inbox
        tag = "push" if channel == PUSH else "pull"
        self.thread = threading.Thread(target=self._run, args=(tag,), daemon=True,
                                       name=f"ps-{tag}-from-{peer}")
        self.thread.start()

    def _run(self, tag: str) -> None:
        while True:
            buf = self.message()
            try:
                self.comm.recv(buf, self.peer, AXIS, tag=tag, channel=self.channel)
            except Exception as exc:   # noqa: BLE001 - handed to the rank's own thread
                self.inbox.put((self.channel, self.peer, exc))
                return
            self.inbox.put((self.channel, self.peer, buf))
            if buf[-HEADER].item() == DONE:
                return


class AsyncParameterServer(ParameterServer):
    """Slots 3 and 4 for dp_mode="ps-async"."""

    timeout_s: float = 120.0

    def __init__(self, named_params, buffers, comm, plan) -> None:
        self.staleness = plan.staleness
        super().__init__(named_params, buffers, comm, plan)
        self.versions = {k: 0 for k in range(self.shards)}   # version held of each shard
        self.computed_on = dict(self.versions)                # ... when the last push left
        self.losses: dict[int, float] = {}    # version -> mean loss of its update's pushes
        self.inbox: queue.Queue = queue.Queue()
        self.mailboxes: list[Mailbox] = []
        self.closed: set[tuple[int, int]] = set()            # (channel, peer) that sent DONE

    def _message(self) -> torch.Tensor:
        length = self.data.numel() // self.shards
        return torch.empty(length + HEADER, dtype=self.data.dtype, device=self.data.device)

    def _open(self) -> None:
        """Start a mailbox for every stream this rank receives (at the first push after
        construction or after a settle)."""
        if self.mailboxes:
            return
        self.closed.clear()
        self.mailboxes = [Mailbox(self.comm, k, PULL, self._message, self.inbox)
                          for k in self.servers()]
        if self.server is not None:
            self.mailboxes += [Mailbox(self.comm, w, PUSH, self._message, self.inbox)
                               for w in range(self.n) if w != self.rank]

    # ---- push ---------------------------------------------------------------------------------
    def _push(self, bucket: Bucket):
        self._open()
        self.computed_on = dict(self.versions)
        for k in range(self.shards):
            grad = self.shard(bucket.buffer, k)
            if k == self.rank:
                self.server.accept(self.rank, self.versions[k], grad, self._loss)
                continue
            header = [float(self.clock), float(self.versions[k]), self._loss]
            message = torch.cat([grad, grad.new_tensor(header)])
            self.sends.add(self.comm.isend(message, k, AXIS, tag="push", channel=PUSH),
                           message)
        return _Sent()

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Push this step's gradient, then wait (serving) for a newer version of every shard
        than the one it was computed on; the loss of shard 0's newest update."""
        self._loss = local_loss.item()
        # no step-wide view of which parameters anyone used: every one counts as stepped
        self._stepped.update(self.named)
        self.grads.flush()        # the pushes: the bucket's launch
        self.clock += 1
        self._wait(self._newer, lambda: "a newer version of every shard")
        self.sends.wait()         # received by now or soon: every peer's mailbox is open
        return self.losses[self.versions[0]]

    def _newer(self) -> bool:
        return all(self.versions[k] > v for k, v in self.computed_on.items())

    def step(self) -> None:
        """Nothing left: the servers stepped as the pushes came in."""

    # ---- serve and pull ----------------------------------------------------------------------
    def _handle(self, channel: int, peer: int, message) -> None:
        """One message from a mailbox: a push to serve, or a version to take."""
        if isinstance(message, Exception):
            raise lost(self.rank, peer, message) from None
        first, second, loss = message[-HEADER:].tolist()
        if first == DONE:
            self.closed.add((channel, peer))
            if channel == PUSH:
                self.server.done.add(peer)
        elif channel == PUSH:
            self.server.accept(peer, int(second), message[:-HEADER], loss)
        else:
            self._take(peer, message[:-HEADER], int(first), second)

    def _publish(self) -> None:
        """A server's new version: into this rank's parameters, and to every worker."""
        version, loss = self.server.version, self.server.losses[self.server.version]
        self._take(self.rank, self.server.master.detach(), version, loss)
        message = torch.cat([self.server.master.detach(),
                             self.server.master.new_tensor([float(version), loss, 0.0])])
        for worker in range(self.n):
            if worker != self.rank:
                self.sends.add(self.comm.isend(message, worker, AXIS, tag="pull",
                                               channel=PULL), message)

    @torch.no_grad()
    def _take(self, k: int, values: torch.Tensor, version: int, loss: float) -> None:
        self.shard(self.data, k).copy_(values)
        self.versions[k] = version
        self.losses[version] = loss

    def _serve(self) -> None:
        """Apply what this rank's server holds, as far as the staleness bound allows."""
        if self.server is not None and self.server.may_update(self.staleness):
            self.server.update()
            self._publish()

    def _wait(self, done, what) -> None:
        """Serve messages until `done()`; name the silent peers after timeout_s without a
        message (twice that on a rank hosting no server: a server knows which worker it
        lacks, so it is given the time to report first and name the rank at fault)."""
        patience = 1 if self.server is not None else 2
        self._serve()
        while not done():
            try:
                self._handle(*self.inbox.get(timeout=patience * self.timeout_s))
                self._serve()
            except queue.Empty:
                raise PeerLost(f"parameter server: dp rank {self.rank} waited "
                               f"{patience * self.timeout_s:.0f} s for {what()} and heard "
                               f"nothing; silent rank(s) {self._silent()}: dead or hung, "
                               "stopping") from None

    def _silent(self) -> list[int]:
        """Peers this rank is waiting on: workers whose push for the server's next update is
        missing, servers whose next version has not come."""
        silent = set()
        if self.server is not None:
            pushed = {w for w, _, _ in self.server.pending.pushes}
            silent |= {w for w in range(self.n)
                       if w not in pushed | self.server.done and w != self.rank}
        silent |= {k for k, v in self.computed_on.items()
                   if self.versions[k] <= v and k != self.rank}
        return sorted(silent)

    def idle(self, seconds: float) -> None:
        """Spend `seconds` (a straggler's delay) serving."""
        self._open()
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self._handle(*self.inbox.get(timeout=left))
                self._serve()
            except queue.Empty:
                return

    # ---- drain --------------------------------------------------------------------------------
    def settle(self) -> None:
        """Finish everything in flight: every push applied, every version taken, every
        mailbox closed; then every rank holds the same parameters. Every rank calls it after
        the same number of steps (a collective in effect)."""
        if not self.mailboxes:
            return
        done = self._message()
        done[-HEADER:] = torch.tensor([DONE, DONE, 0.0], device=done.device)
        for k in self.servers():
            self.sends.add(self.comm.isend(done, k, AXIS, tag="push", channel=PUSH), done)
        if self.server is not None:
            self.server.done.add(self.rank)
            workers = {(PUSH, w) for w in range(self.n) if w != self.rank}
            self._wait(lambda: workers <= self.closed and not self.server.pending.pushes,
                       lambda: "every worker's last push")
            closing = self._message()
            closing[-HEADER:] = torch.tensor([DONE, 0.0, 0.0], device=closing.device)
            for worker in range(self.n):
                if worker != self.rank:
                    self.sends.add(self.comm.isend(closing, worker, AXIS, tag="pull",
                                                   channel=PULL), closing)
        servers = {(PULL, k) for k in self.servers()}
        self._wait(lambda: servers <= self.closed, lambda: "every server's last version")
        self.sends.wait()
        for mailbox in self.mailboxes:
            mailbox.thread.join()
        self.mailboxes = []
        self.computed_on = dict(self.versions)
        if self.server is not None:   # every worker now holds the newest version
            self.server.done.clear()
            self.server.floor = {w: self.server.version for w in self.server.floor}

    def staleness_record(self) -> list[tuple[int, int, int]]:
        """(worker, version computed on, versions stale) of every gradient this rank's
        server applied, in the order applied."""
        return list(self.server.staleness) if self.server is not None else []


class _Sent:
    """The bucket's handle: pushes are waited for at the step's end, not here."""

    def wait(self) -> None:
        pass
