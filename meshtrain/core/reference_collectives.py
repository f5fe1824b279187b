"""Reference all-reduce algorithms built on send/recv only, to teach and to verify.

Both reduce a tensor in place along one mesh axis and give the same result as c10d's
all_reduce. They differ in who carries the traffic (per rank, S = tensor bytes, N = ranks):

- ring (reduce-scatter, then all-gather): every rank sends and receives 2(N-1)/N * S.
  Bandwidth-optimal and balanced; N-1 steps in each phase.
- parameter server (reduce to a root, then broadcast): the root receives (N-1)*S and sends
  (N-1)*S, every other rank sends S and receives S. The root's link is the bottleneck.

The fast path (`Comm.all_reduce`) uses c10d's collective; these exist so that tests can check
the counters against theory exactly and readers can see the algorithms in thirty lines.
"""
from __future__ import annotations

import torch

from meshtrain.core.comm import Comm


def _exchange(comm: Comm, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              axis: str, tag: str) -> None:
    """Send to one neighbour while receiving from the other (no deadlock on a ring)."""
    handles = []
    if send.numel():
        handles.append(comm.isend(send, dst, axis, tag))
    if recv.numel():
        handles.append(comm.irecv(recv, src, axis, tag))
    for h in handles:
        h.wait()


def ring_reduce_scatter(comm: Comm, chunks: list[torch.Tensor], axis: str,
                        tag: str = "ring") -> int:
    """Sum `chunks` (N views of one flat tensor) around the ring.

    After N-1 steps this rank holds the full sum of chunk (rank+1) % N; returns that index.
    Step s: send chunk (r-s) % N to the right, add the left's chunk (r-s-1) % N into ours.
    """
    n, r = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx, recv_idx = (r - step) % n, (r - step - 1) % n
        incoming = torch.empty_like(chunks[recv_idx])
        _exchange(comm, chunks[send_idx], right, incoming, left, axis, tag)
        chunks[recv_idx].add_(incoming)
    return (r + 1) % n


def ring_all_gather(comm: Comm, chunks: list[torch.Tensor], axis: str,
                    tag: str = "ring") -> None:
    """Circulate the chunks so that every rank ends with all of them.

    Starts from rank r owning chunk (r+1) % N (where `ring_reduce_scatter` leaves it).
    Step s: send chunk (r+1-s) % N to the right, receive chunk (r-s) % N from the left.
    """
    n, r = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx, recv_idx = (r + 1 - step) % n, (r - step) % n
        _exchange(comm, chunks[send_idx], right, chunks[recv_idx], left, axis, tag)


def ring_all_reduce(comm: Comm, tensor: torch.Tensor, axis: str, tag: str = "ring") -> None:
    """All-reduce (sum) `tensor` in place: ring reduce-scatter, then ring all-gather."""
    if comm.mesh.size(axis) == 1:
        return
    flat = tensor.view(-1)  # chunks are views: reducing them reduces `tensor`
    chunks = list(flat.tensor_split(comm.mesh.size(axis)))
    ring_reduce_scatter(comm, chunks, axis, tag)
    ring_all_gather(comm, chunks, axis, tag)


def parameter_server_all_reduce(comm: Comm, tensor: torch.Tensor, axis: str, root: int = 0,
                                tag: str = "ps") -> None:
    """All-reduce (sum) `tensor` in place: every worker sends to `root`, which sums and
    sends the total back to each."""
    n, r = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
    if n == 1:
        return
    if r == root:
        incoming = torch.empty_like(tensor)
        for worker in range(n):
            if worker != root:
                comm.recv(incoming, worker, axis, tag)
                tensor.add_(incoming)
        for worker in range(n):
            if worker != root:
                comm.send(tensor, worker, axis, tag)
    else:
        comm.send(tensor, root, axis, tag)
        comm.recv(tensor, root, axis, tag)
