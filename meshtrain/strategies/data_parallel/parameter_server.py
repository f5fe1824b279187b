"""Parameter server, synchronous (`Plan(dp=N, dp_mode="ps-sync", ps_shards=K)`).

Every dp rank is a worker with the whole model; the parameters and the optimizer live on the
servers. The flat parameters (one bucket, buckets.py, padded to K) are cut into K contiguous
shards and server shard k lives on dp rank k (ps_server.py), beside that rank's worker.

    backward   gradients land in the flat bucket (the hooks DDP uses), scaled by 1/N
    push       each worker sends shard k of its gradient to server k (point to point)
    reduce     server k sums the N pushes, in rank order (= DDP's average)
    step       server k's optimizer steps its shard
    pull       server k sends the updated shard to every worker

Per step a single server (K = 1) receives (N-1)*S and sends (N-1)*S (S the parameter bytes),
every other rank sends and receives S: the root's link carries everything, where DDP's ring
puts 2(N-1)/N*S on every rank. With K shards each server carries 1/K of the root's load;
with K = N every rank moves 2(N-1)/N*S, like the ring. Pushes are charged under the tag
"push", pulls under "pull" (Comm's send/recv: exact bytes, one call per message).

The step's loss, and which parameters any worker used (a parameter nobody used is left as
one process's optimizer leaves it: keep_unstepped, as ZeRO does), travel in one small
all-reduce beside the gradients (tag "step").
ps_async.py lets the servers apply pushes as they arrive, with bounded staleness.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.optim_state import flat_state_by_name
from meshtrain.core.plan import Plan, PlanError
from meshtrain.strategies.data_parallel.ps_server import ServerShard
from meshtrain.strategies.shared.buckets import Bucket, build_buckets
from meshtrain.strategies.shared.flat import FlatLayout, flatten_into_buckets, keep_unstepped
from meshtrain.strategies.shared.gradient_buckets import GradientBuckets
from meshtrain.strategies.shared.replicas import broadcast_tensors
from meshtrain.strategies.slots import GradientSync

AXIS = "dp"


class PeerLost(RuntimeError):
    """A peer's connection failed, or it sent nothing for too long: the message names its
    dp rank, so that the rank at fault is reported and the others stop."""


def lost(rank: int, peer: int, exc: BaseException) -> PeerLost:
    return PeerLost(f"parameter server: dp rank {rank} lost dp rank {peer} "
                    f"({type(exc).__name__}: {exc}); rank {peer} is dead, stopping")


class _Sends:
    """Handles of point-to-point sends in flight (their tensors kept alive until done)."""

    def __init__(self) -> None:
        self.inflight: list[tuple[object, torch.Tensor]] = []

    def add(self, work, tensor: torch.Tensor) -> None:
        self.inflight.append((work, tensor))

    def wait(self) -> None:
        for work, _ in self.inflight:
            work.wait()
        self.inflight.clear()


class ParameterServer(GradientSync):
    """Slots 3 and 4 for dp_mode="ps-sync": workers push gradients to the server shards,
    which own the optimizer, and pull the updated parameters back."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, plan: Plan) -> None:
        self.comm = comm.on_host()   # a parameter server's traffic is a host concept
        self.n, self.rank = comm.mesh.size(AXIS), comm.mesh.axis_rank(AXIS)
        self.shards = plan.ps_shards
        broadcast_tensors([p for _, p in named_params] + list(buffers), comm, AXIS)
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self.params = list(self.named.values())
        names = {id(p): n for n, p in self.named.items()}
        # one flat bucket: its gradient is what a worker pushes, its parameters what it pulls
        self.buckets = build_buckets(self.params[::-1], float("inf"), pad_to=self.shards)
        if len(self.buckets) != 1:
            raise PlanError("a parameter server keeps the parameters as one flat tensor: they "
                            "must share one dtype and device")
        self.bucket = self.buckets[0]
        # the padding to K shards: never written by backward, but pushed, summed and counted
        # in the gradient norm, so it must hold zeros (the buffer comes uninitialised)
        self.bucket.extra.zero_()
        self.data = flatten_into_buckets(self.buckets, self.params[0].dtype)[0]
        self.layout = FlatLayout(self.buckets, names, self.shards,
                                 self.rank if self.rank < self.shards else 0)
        self.server = (ServerShard(self.rank, self.shard(self.data, self.rank), self.n)
                       if self.rank < self.shards else None)
        self.grads = GradientBuckets(self.params, self.buckets, self._push, scale=1.0 / self.n,
                                     hold_last=True)
        self.sends = _Sends()
        self.clock = 0   # steps this worker has pushed
        self._skipped: list[str] = []     # no worker used them this step (see step())
        self._stepped: set[str] = set()   # the optimizer has stepped them, ever
        self.zero_grad()

    def shard(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Server k's contiguous slice of a flat tensor (a view)."""
        return flat.view(self.shards, -1)[k]

    def servers(self) -> list[int]:
        """The dp ranks hosting a server shard other than this rank."""
        return [k for k in range(self.shards) if k != self.rank]

    # ---- the step (slot 3) ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.grads.start_step()

    def no_sync(self):
        """Accumulate in the bucket (earlier micro-batches): no push."""
        return self.grads.paused()

    def _push(self, bucket: Bucket):
        """Send shard k of the flat gradient to server k (this rank's own shard stays)."""
        for k in self.servers():
            grad = self.shard(bucket.buffer, k)
            self.sends.add(self.comm.isend(grad, k, AXIS, tag="push"), grad)
        return self.sends

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Push; on a server, receive every worker's push in rank order and sum them."""
        self.grads.flush()
        if self.server is not None:
            incoming = torch.empty_like(self.server.master)
            for worker in range(self.n):
                grad = self.shard(self.bucket.buffer, self.rank)
                if worker != self.rank:
                    try:
                        self.comm.recv(incoming, worker, AXIS, tag="push")
                    except RuntimeError as exc:
                        raise lost(self.rank, worker, exc) from None
                    grad = incoming
                self.server.accept(worker, self.clock, grad, 0.0)
        self.grads.wait()
        # the loss, and which parameters any worker used, in one small all-reduce
        stats = torch.cat([local_loss.reshape(1).float(), self.grads.used_flags()])
        self.comm.all_reduce(stats, AXIS, tag="step")
        loss, *used_by = stats.tolist()   # one host sync: the loss and the flags
        self._skipped = [n for n, users in zip(self.named, used_by) if not users]
        self._stepped.update(n for n, users in zip(self.named, used_by) if users)
        return loss / self.n

    # ---- the optimizer (slot 4) -------------------------------------------------------------
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's server shard; a rank hosting no shard gets
        one over an empty tensor (it never steps) so that its learning rate can be set."""
        if self.server is not None:
            self.optimizer = self.server.build_optimizer(factory)
        else:
            self.optimizer = factory([nn.Parameter(self.data.new_empty(0))])
        return self.optimizer

    def step(self) -> None:
        """Servers step their shard and send it to every worker; workers receive them."""
        if self.server is not None:
            # a parameter no worker used is left as one process's optimizer leaves it
            with keep_unstepped(self.layout, self._skipped, [self.server.master],
                                self.optimizer):
                self.server.update()
            self._publish()
        handles = {k: self.comm.irecv(self.shard(self.data, k), k, AXIS, tag="pull")
                   for k in self.servers()}
        for k, h in handles.items():
            try:
                h.wait()
            except RuntimeError as exc:
                raise lost(self.rank, k, exc) from None
        self.sends.wait()
        self.clock += 1

    def _publish(self) -> None:
        """A server's new version: into this rank's own parameters, and to every worker."""
        with torch.no_grad():
            self.shard(self.data, self.rank).copy_(self.server.master)
        for worker in range(self.n):
            if worker != self.rank:
                self.sends.add(self.comm.isend(self.server.master.detach(), worker, AXIS,
                                               tag="pull"), self.server.master)

    # ---- after the sync: clipping -----------------------------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return None   # no other axis to sum over: parameter servers run with pp = tp = 1

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        """Each server counts its summed shard (the padding is zero)."""
        total = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        if self.server is not None:
            total += self.server.reduced().double().square().sum()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        if self.server is not None:
            grad = self.server.reduced()
            grad.mul_(factor.to(grad.dtype))

    # ---- state ------------------------------------------------------------------------------
    def local_parameters(self) -> dict[str, torch.Tensor]:
        self.settle()
        return {n: t.detach() for n, t in self.layout.split([self.data]).items()}

    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        """Per-parameter states on every rank: each server's per-element states broadcast
        from it and cut per parameter; a 0-dim state (Adam's step) copied to each."""
        self.settle()
        mine = {}
        if self.server is not None:
            for key, value in self.optimizer.state.get(self.server.master, {}).items():
                per_element = isinstance(value, torch.Tensor) and value.dim() > 0
                mine[key] = (["flat", str(value.dtype)] if per_element else
                             ["value", float(value), str(value.dtype)
                              if isinstance(value, torch.Tensor) else None])
        kinds = self.comm.gather_objects(mine, tag="state")[0]   # server 0 speaks for all
        state: dict[str, dict] = {n: {} for n in self.named}
        for key, kind in kinds.items():
            if kind[0] == "flat":
                dtype = getattr(torch, kind[1].removeprefix("torch."))
                flat = torch.empty(self.data.numel(), dtype=dtype, device=self.data.device)
                for k in range(self.shards):
                    part = self.shard(flat, k)
                    if k == self.rank:
                        part.copy_(self.optimizer.state[self.server.master][key])
                    self.comm.broadcast(part, k, AXIS, tag="state")
                for name, t in self.layout.split([flat]).items():
                    state[name][key] = t.clone()
            else:
                for name in state:
                    state[name][key] = (torch.tensor(kind[1], dtype=getattr(
                        torch, kind[2].removeprefix("torch."))) if kind[2] else kind[1])
        return flat_state_by_name(self.optimizer, state, self._stepped, list(self.named))

    @torch.no_grad()
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        self.settle()
        self.data.copy_(self.layout.join(params, self.data.dtype, self.data.device)[0])
        self.zero_grad()
        if optimizer_state is not None:
            self._stepped = set(optimizer_state[0]) & set(self.named)
        if self.server is None:
            return
        self.server.master.copy_(self.shard(self.data, self.rank))
        if optimizer_state is None:
            return
        state, groups = optimizer_state
        out = {}
        for key in sorted({k for s in state.values() for k in s}):
            first = next(s[key] for s in state.values() if key in s)
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                full = {n: state.get(n, {}).get(key, torch.zeros(self.layout.by_name[n].shape,
                                                              device=self.data.device))
                        for n in self.named}
                flat = self.layout.join(full, first.dtype, self.data.device)[0]
                out[key] = self.shard(flat, self.rank).clone()
            else:
                out[key] = first.clone() if isinstance(first, torch.Tensor) else first
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        self.optimizer.load_state_dict({"state": {0: out} if out else {},
                                        "param_groups": [{**hyper, "params": [0]}]})

    # ---- accounting -------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """A worker's flat parameters and gradient bucket; a server's master shard, pending
        gradients and optimizer states on top."""
        params, grads, optimizer = [self.data], [self.bucket.buffer], []
        if self.server is not None:
            params.append(self.server.master)
            grads.append(self.server.pending.grad)
            optimizer = optimizer_state_tensors(self.optimizer)
        return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads),
                "optimizer_states": storage_bytes(optimizer)}

    @property
    def flat_bytes(self) -> int:
        """S: the flat parameters' bytes (padded to a multiple of the shard count)."""
        return self.data.numel() * self.data.element_size()

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()
