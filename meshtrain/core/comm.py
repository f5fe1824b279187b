"""Accounted communication: every collective and send/recv meshtrain issues goes through `Comm`.

`Comm` is a thin layer over c10d that also counts, per (axis, operation, tag), the calls and
the bytes this rank sent and received (`CommStats`). Tests assert theory against these
counters, the CLI prints them per step, the planner calibrates against them.

[Note: what a collective is charged]
send/recv are charged their exact bytes. A c10d collective's wire traffic depends on the
algorithm the backend picks, so it is charged what the bandwidth-optimal ring moves, exactly
as our reference ring in `reference_collectives.py` moves it (chunks from `tensor_split`):
all_reduce ~ 2(N-1)/N*S sent and received, reduce_scatter and all_gather ~ (N-1)/N*S (S the
full, unsharded size); broadcast charges the root (N-1)*S sent and every other rank S received.
A group of one rank communicates nothing and is charged nothing.

[Note: reduce-scatter as an all-to-all]
gloo's reduce_scatter is slow: an all-to-all of the same tensor followed by a local sum of
the N received slices takes about half its time from 1 to 64 MiB (figures in docs/history.md);
a blocking ring on isend/irecv lands between the two and cannot overlap backward. The
all-to-all moves the same bytes as a ring reduce-scatter ((N-1)/N*S per rank), runs
asynchronously on gloo's own threads, sums in a fixed rank order, and can sum narrow inputs
into a wider output (bf16 on the wire, fp32 sums). So on gloo, and whenever the output is
wider than the input, `reduce_scatter` is that all-to-all; on NCCL, with equal dtypes, it is
NCCL's own reduce-scatter.

[Note: all-gather as an all-to-all]
gloo's all-gather stages its whole output in a buffer of its own, allocated on the worker
thread that runs it, then copies it out: each of gloo's threads keeps that output's size in
its own malloc arena, so a rank's resident memory jumps by one output whenever a gather
first runs on the other thread. On gloo, `all_gather` is therefore an all-to-all of this
rank's input repeated N times, built on the calling thread: the same bytes on the wire
((N-1)/N*S per rank), no copy out. It is not faster at every size; what it buys is resident
memory that does not depend on which thread ran (figures in docs/history.md). NCCL gathers
in place.

[Note: devices and backends]
NCCL takes only CUDA tensors; `Comm` refuses a host tensor on an NCCL group by name
(`check_device`) rather than let NCCL fail deep inside c10d. gloo's collectives stage CUDA
tensors through host memory themselves, but its send/recv hand the tensor's raw pointer to
TCP: `Comm`'s point-to-point therefore stages a CUDA tensor on a gloo group through a host
copy (sends copy out first, receives copy back once they complete). A group whose backend
serves both ("cpu:gloo,cuda:nccl") takes either.
"""
from __future__ import annotations

import json
import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from meshtrain.core.handles import Done, Gauge, Then
from meshtrain.core.mesh import AXES, GROUP_AXES, Mesh
from meshtrain.core.watchdog import CollectiveLog

# torch 2.13 names the flat collectives *_single and deprecates the older names, which are all
# that releases before it have (torch 2.11 on the GPU machines meshtrain runs on)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


@dataclass
class Traffic:
    calls: int = 0
    sent: int = 0       # bytes this rank put on the wire
    received: int = 0   # bytes this rank took off the wire

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.calls + other.calls, self.sent + other.sent,
                       self.received + other.received)


class CommStats:
    """Counters of calls and bytes per (axis, op, tag) on this rank."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str, str], Traffic] = defaultdict(Traffic)
        self._lock = threading.Lock()   # a parameter server receives on threads of its own

    def record(self, axis: str, op: str, tag: str, sent: int, received: int) -> None:
        with self._lock:
            t = self.counters[(axis, op, tag)]
            t.calls += 1
            t.sent += sent
            t.received += received

    def total(self, axis: str | None = None, op: str | None = None,
              tag: str | None = None) -> Traffic:
        """Sum over the counters that match every filter given."""
        out = Traffic()
        for (a, o, t), traffic in self.counters.items():
            if (axis in (None, a)) and (op in (None, o)) and (tag in (None, t)):
                out = out + traffic
        return out

    def reset(self) -> None:
        self.counters.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """JSON-friendly copy: "axis/op[tag]" -> {calls, sent, received}."""
        return {f"{a}/{o}" + (f"[{t}]" if t else ""): vars(tr).copy()
                for (a, o, t), tr in sorted(self.counters.items())}


def ring_chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of the n ring chunks of a flat tensor (as `tensor_split` makes them)."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def ring_all_reduce_elements(numel: int, n: int, rank: int) -> int:
    """Elements rank `rank` sends in a ring all-reduce: every chunk but one in each phase."""
    if n == 1:
        return 0
    sizes = ring_chunk_sizes(numel, n)
    return 2 * numel - sizes[(rank + 1) % n] - sizes[(rank + 2) % n]


def ring_all_reduce_received_elements(numel: int, n: int, rank: int) -> int:
    """Elements rank `rank` receives in a ring all-reduce: every chunk but its own in the
    reduce-scatter, every chunk but the one it finished with, (rank+1) % n, in the all-gather.
    Equal to `ring_all_reduce_elements` when n divides numel; it differs per rank otherwise."""
    if n == 1:
        return 0
    sizes = ring_chunk_sizes(numel, n)
    return 2 * numel - sizes[rank] - sizes[(rank + 1) % n]


def ring_half_elements(numel: int, n: int, rank: int) -> int:
    """Elements sent in one ring phase (reduce-scatter or all-gather): all chunks but one."""
    if n == 1:
        return 0
    return numel - ring_chunk_sizes(numel, n)[(rank + 1) % n]


@dataclass
class P2P:
    """One transfer of a point-to-point batch: send `tensor` to the axis rank `peer`, or
    receive into it from `peer`. `match` is the c10d tag that pairs a send with its
    receive, so that several messages between two ranks never mix. `tag`: the counters'
    tag for this transfer, where one batch carries several kinds (default: the batch's)."""
    tensor: torch.Tensor
    peer: int
    send: bool
    match: int = 0
    tag: str | None = None


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


def _copy(into: torch.Tensor, src: torch.Tensor) -> None:
    into.copy_(src)


def check_device(tensor: torch.Tensor, group) -> None:
    """Refuse a tensor the group's backend cannot carry: a host tensor on an NCCL group."""
    backend = dist.get_backend(group)
    if backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(f"a {tensor.device.type} tensor of shape {tuple(tensor.shape)} was "
                         "passed to an NCCL group, which carries CUDA tensors only: create it "
                         "on the mesh's device (comm.mesh.device) or use a gloo group")


def _stages_p2p(tensor: torch.Tensor, group) -> bool:
    """gloo's send/recv cannot read or write CUDA memory: such a tensor goes through host."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


class Comm:
    """Accounted collectives along the axes of one mesh. One per rank; passed explicitly."""

    def __init__(self, mesh: Mesh, stats: CommStats | None = None) -> None:
        self.mesh = mesh
        self.stats = stats if stats is not None else CommStats()
        self.log = CollectiveLog()   # the call sequence the watchdog compares between ranks
        self.link = None             # a core.link.LinkModel: sleeps the modelled time per call
        self.staging = Gauge()       # gloo's whole buffers beside a gather's or scatter's output

    def group(self, axis: str):
        """The process group this Comm uses along `axis`."""
        return self.mesh.group(axis)

    def on_host(self) -> "Comm":
        """This Comm over gloo groups of the same ranks, sharing its counters and log: for
        traffic that is a host concept (a parameter server's pushes and pulls, whose
        receives stay posted per peer, which NCCL cannot match by tag). CUDA tensors are
        staged through host memory (see [Note: devices and backends]). Where the mesh's
        groups are gloo already, they are used as they are; else collective: every rank
        calls it at the same point."""
        from meshtrain.core.host_comm import HostComm
        return HostComm(self)

    def _active(self, axis: str) -> bool:
        return self.mesh.size(axis) > 1

    def _account(self, axis: str, op: str, tag: str, sent: int, received: int,
                 tensor: torch.Tensor) -> None:
        if axis in GROUP_AXES and self.mesh.device_mesh is not None:   # not "world"
            check_device(tensor, self.group(axis))
        self.stats.record(axis, op, tag, sent, received)
        self.log.enter(op, axis, tag, tensor)
        if self.link is not None and axis in AXES:
            self.link.charge(axis, op, sent, received, self.mesh.size(axis))

    # ---- collectives --------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum", tag: str = "",
                   async_op: bool = False):
        """Reduce `tensor` in place over `axis` ("sum", "avg" or "max"); every member gets the
        result."""
        if not self._active(axis):
            return Done() if async_op else None
        n, r = self.mesh.size(axis), self.mesh.axis_rank(axis)
        sent = ring_all_reduce_elements(tensor.numel(), n, r) * tensor.element_size()
        received = ring_all_reduce_received_elements(tensor.numel(), n, r) * tensor.element_size()
        self._account(axis, "all_reduce", tag, sent, received, tensor)
        return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group(axis),
                               async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                       op: str = "sum", tag: str = "", async_op: bool = False):
        """`output` (1/N of `input`) receives this rank's slice of the reduction of `input`.

        `output` may have a wider dtype than `input` (bf16 on the wire, summed in fp32). See
        [Note: reduce-scatter as an all-to-all] for how it runs."""
        if input.numel() != output.numel() * self.mesh.size(axis):
            raise ValueError(f"reduce_scatter over {axis}: input of {input.numel()} elements "
                             f"is not {self.mesh.size(axis)} x output ({output.numel()})")
        if not self._active(axis):
            output.copy_(input.reshape(output.shape))
            return Done() if async_op else None
        n, r = self.mesh.size(axis), self.mesh.axis_rank(axis)
        nbytes = ring_half_elements(input.numel(), n, r) * input.element_size()
        self._account(axis, "reduce_scatter", tag, nbytes, nbytes, input)
        group = self.group(axis)
        if dist.get_backend(group) != "gloo" and output.dtype == input.dtype:
            return reduce_scatter_single(output, input, op=_REDUCE_OPS[op], group=group,
                                         async_op=async_op)
        received = torch.empty_like(input)   # (N, k): row j is rank j's slice for us
        self.staging.add(received.nbytes)
        sent = input.reshape(-1).detach()   # no view of `input` (set_ below frees only ours)
        work = dist.all_to_all_single(received, sent, group=group, async_op=True)

        def reduce() -> None:
            torch.sum(received.view(n, -1), dim=0, dtype=output.dtype, out=output.view(-1))
            if op == "avg":
                output.div_(n)
            self.staging.sub(received.nbytes)
            received.set_(), sent.set_()   # freed here: gloo's thread's frees escape profilers
        handle = Then(work, reduce)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, tag: str = "",
                   async_op: bool = False):
        """`output` (N times `input`) receives every member's `input`, in axis-rank order."""
        if not self._active(axis):
            output.copy_(input.reshape(output.shape))
            return Done() if async_op else None
        n, r = self.mesh.size(axis), self.mesh.axis_rank(axis)
        nbytes = ring_half_elements(output.numel(), n, r) * output.element_size()
        self._account(axis, "all_gather", tag, nbytes, nbytes, input)
        group = self.group(axis)
        if dist.get_backend(group) != "gloo" or not output.is_contiguous():
            return all_gather_single(output, input, group=group, async_op=async_op)
        # see [Note: all-gather as an all-to-all]
        repeated = input.reshape(1, -1).expand(n, -1).contiguous()
        self.staging.add(repeated.nbytes)
        handle = Then(dist.all_to_all_single(output.view(-1), repeated.view(-1), group=group,
                                             async_op=True),
                      lambda: self.staging.sub(repeated.nbytes))
        if async_op:
            return handle
        handle.wait()
        return None

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, axis: str, tag: str = "",
                   output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None) -> None:
        """Rows of `input` (dim 0) go to the axis ranks in order, `output` receives each
        rank's rows in rank order: N equal parts, or `input_splits` rows to each rank and
        `output_splits` from each (uneven counts allowed). Charged its exact bytes: the rows
        that leave this rank, and those that arrive."""
        if not self._active(axis):
            output.copy_(input)
            return
        n, r = self.mesh.size(axis), self.mesh.axis_rank(axis)
        if input_splits is None:
            sent = received = ring_half_elements(input.numel(), n, r) * input.element_size()
        else:
            row = math.prod(input.shape[1:]) * input.element_size()   # bytes of one row
            sent = (sum(input_splits) - input_splits[r]) * row
            received = (sum(output_splits) - output_splits[r]) * row
        self._account(axis, "all_to_all", tag, sent, received, input)
        dist.all_to_all_single(output, input, output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=self.group(axis))

    def broadcast(self, tensor: torch.Tensor, src: int, axis: str, tag: str = "",
                  async_op: bool = False):
        """Copy `tensor` from the member with axis rank `src` to every member of the axis."""
        if not self._active(axis):
            return Done() if async_op else None
        n, nbytes = self.mesh.size(axis), tensor.numel() * tensor.element_size()
        is_src = self.mesh.axis_rank(axis) == src
        self._account(axis, "broadcast", tag, (n - 1) * nbytes if is_src else 0,
                      0 if is_src else nbytes, tensor)
        return dist.broadcast(tensor, src=self.mesh.global_rank(axis, src),
                              group=self.group(axis), async_op=async_op)

    def barrier(self, axis: str | None = None) -> None:
        if axis is None:
            if dist.is_initialized():
                dist.barrier()
        elif self._active(axis):
            dist.barrier(group=self.group(axis))

    def gather_objects(self, obj, tag: str = "") -> list:
        """Every rank's JSON-serialisable `obj`, in rank order, on every rank (for reports,
        not for training data). JSON, not pickle: what a peer sends is data, never code.
        Two all-gathers over the whole world (the sizes, then the padded texts), charged
        under the axis "world" as ring all-gathers."""
        if not (dist.is_available() and dist.is_initialized()) or self.mesh.world_size == 1:
            return [json.loads(json.dumps(obj))]
        n, rank, device = self.mesh.world_size, self.mesh.rank, self.mesh.device
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
        sizes = torch.zeros(n, dtype=torch.int64, device=device)
        self._gather_world(sizes, torch.tensor([data.numel()], device=device), tag, rank)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data
        texts = torch.zeros(n * longest, dtype=torch.uint8, device=device)
        self._gather_world(texts, padded, tag, rank)
        rows = texts.view(n, longest).cpu()
        return [json.loads(bytes(rows[r, :int(sizes[r])].tolist())) for r in range(n)]

    def _gather_world(self, output: torch.Tensor, input: torch.Tensor, tag: str,
                      rank: int) -> None:
        nbytes = ring_half_elements(output.numel(), self.mesh.world_size, rank) * output.element_size()
        self._account("world", "all_gather", tag, nbytes, nbytes, input)
        all_gather_single(output, input)

    # ---- point to point -----------------------------------------------------------------
    # `channel` is c10d's message tag: messages between two ranks on one channel are matched
    # in order; independent streams between the same pair (a parameter server's pushes and
    # pulls) need channels of their own.
    def isend(self, tensor: torch.Tensor, dst: int, axis: str, tag: str = "", channel: int = 0):
        """Start sending `tensor` to the member with axis rank `dst`; returns a handle."""
        self._account(axis, "send", tag, tensor.numel() * tensor.element_size(), 0, tensor)
        group = self.group(axis)
        wire = tensor.cpu() if _stages_p2p(tensor, group) else tensor.contiguous()
        work = dist.isend(wire, dst=self.mesh.global_rank(axis, dst), group=group, tag=channel)
        return Then(work, lambda: wire) if wire is not tensor else work

    def irecv(self, tensor: torch.Tensor, src: int, axis: str, tag: str = "", channel: int = 0):
        """Start receiving into `tensor` from the member with axis rank `src`."""
        self._account(axis, "recv", tag, 0, tensor.numel() * tensor.element_size(), tensor)
        group = self.group(axis)
        if not _stages_p2p(tensor, group):
            return dist.irecv(tensor, src=self.mesh.global_rank(axis, src), group=group,
                              tag=channel)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        work = dist.irecv(host, src=self.mesh.global_rank(axis, src), group=group, tag=channel)
        return Then(work, lambda: tensor.copy_(host))

    def batch_isend_irecv(self, ops: list["P2P"], axis: str, tag: str = "") -> list:
        """Post every send and receive of `ops` at once (one c10d batch: none waits for
        another, so a send and a receive between two ranks cannot block each other); each
        charged its exact bytes. Returns one handle per op."""
        p2p, copy_back = [], []
        group = self.group(axis)
        for op in ops:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            self._account(axis, "send" if op.send else "recv", tag if op.tag is None else op.tag,
                          nbytes if op.send else 0, 0 if op.send else nbytes, op.tensor)
            wire = op.tensor
            if _stages_p2p(wire, group):   # see [Note: devices and backends]
                wire = wire.cpu() if op.send else torch.empty(
                    wire.shape, dtype=wire.dtype, device="cpu")
            copy_back.append(None if op.send or wire is op.tensor else (op.tensor, wire))
            p2p.append(dist.P2POp(dist.isend if op.send else dist.irecv, wire,
                                  self.mesh.global_rank(axis, op.peer), group=group,
                                  tag=op.match))
        works = dist.batch_isend_irecv(p2p) if p2p else []
        return [work if back is None else Then(work, partial(_copy, *back))
                for work, back in zip(works, copy_back)]

    def send(self, tensor: torch.Tensor, dst: int, axis: str, tag: str = "",
             channel: int = 0) -> None:
        self.isend(tensor, dst, axis, tag, channel).wait()

    def recv(self, tensor: torch.Tensor, src: int, axis: str, tag: str = "",
             channel: int = 0) -> None:
        self.irecv(tensor, src, axis, tag, channel).wait()

