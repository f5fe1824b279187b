"""The data-parallel family's traffic through its busiest rank, for `meshtrain plan`: why DDP
wins where it does (pure functions; measured against in docs/data-parallel-family.md).

With N replicas and S bytes of gradients (P of parameters), per step:

    DDP (ring all-reduce)        every rank   2(N-1)/N * S each way
    parameter server, 1 shard    the root     (N-1) * S in, (N-1) * P out
    parameter server, N shards   each rank    (N-1)/N * S in and out as a server, the other
                                              shards out and back as a worker: the ring's load
    DP with a master device      the master   (N-1) * P out, (N-1) * S in, plus the logits it
                                              gathers and their gradients; one node only

A root's pushes arrive one after another on its one link, then the pulls leave the same way,
so its time is (N-1) point-to-point transfers each way: N/2 times the ring's bytes, and it
grows with N where the ring's stays below 2S.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Setup


@dataclass(frozen=True)
class Busiest:
    strategy: str
    bytes_per_step: float   # sent + received by the busiest rank
    seconds: float          # its communication time per step, nothing overlapped
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def family(spec: ModelSpec, setup: Setup, cluster: Cluster, n: int | None = None
           ) -> list[Busiest]:
    """DDP, the parameter server (1 and N shards) and DP, with `n` replicas (default: every
    device of the cluster, pp = tp = 1)."""
    n = n or cluster.world
    grads = spec.num_params * setup.grad_bytes
    params = spec.num_params * setup.param_bytes
    p2p = lambda nbytes: cluster.collective_time("p2p", nbytes, 2, n)
    ring = 2 * (n - 1) / n
    out = [Busiest("DDP", 2 * ring * grads, cluster.collective_time("all_reduce", grads, n, n),
                   "ring all-reduce: every rank carries the same share")]
    out.append(Busiest("parameter server, 1 shard", (n - 1) * (grads + params),
                       (n - 1) * (p2p(grads) + p2p(params)),
                       "the root receives every push and sends every pull"))
    out.append(Busiest(f"parameter server, {n} shards", (n - 1) / n * 2 * (grads + params),
                       (n - 1) * (p2p(grads / n) + p2p(params / n)),
                       "each rank serves 1/N: the ring's bytes, in 4(N-1) messages"))
    logits = setup.global_batch * spec.seq * spec.vocab * setup.act_bytes * (n - 1) / n
    one_node = n <= cluster.gpus_per_node
    out.append(Busiest("DP (master device)", (n - 1) * (grads + params) + 2 * logits,
                       (n - 1) * (p2p(grads) + p2p(params)) + 2 * p2p(logits),
                       "one process: its replicas must share a node" if one_node else
                       f"not possible: {n} replicas exceed a node's {cluster.gpus_per_node} "
                       "devices"))
    return out


def words(spec: ModelSpec, setup: Setup, cluster: Cluster, n: int | None = None) -> str:
    """The comparison in a paragraph for `meshtrain plan`."""
    n = n or cluster.world
    rows = family(spec, setup, cluster, n)
    ddp, root = rows[0], rows[1]
    lines = [f"Data parallel over {n} replicas (pp = tp = 1), per step through the busiest "
             "rank:"]
    for r in rows:
        lines.append(f"  - {r.strategy}: {r.bytes_per_step / 1e9:.3g} GB, "
                     f"{r.seconds:.3g} s ({r.note}).")
    if n > 2:
        lines.append(f"DDP wins: a single server's root carries {root.bytes_per_step / ddp.bytes_per_step:.2g}x "
                     "DDP's bytes (N/2) and grows with N, while the ring keeps every rank "
                     "below 2S; a server sharded over all N ranks moves the ring's bytes but "
                     "in 4(N-1) messages per step.")
    else:
        lines.append("At 2 replicas the root and the ring move the same bytes: the choice "
                     "is memory (servers own the optimizer states) and messages.")
    return "\n".join(lines)
