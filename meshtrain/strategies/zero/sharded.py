"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020): every data-parallel rank keeps the whole
model but owns 1/N of the optimizer states (ZeRO-1, P_os) and of the gradients (ZeRO-2,
P_os+g), as flat padded shards (flat.py).

An all-reduce is a reduce-scatter followed by an all-gather; ZeRO moves the same bytes as
DDP but puts the optimizer step between the two halves, on the shard alone:

    backward   gradients land in buckets (the hooks DDP uses, gradient_buckets.py); each
               full bucket is reduce-scattered at once, overlapping the rest of backward:
               rank r receives the dp-average of its k elements of the bucket
    step       the optimizer steps rank r's shard (fp32 masters under bf16)
    after      each bucket's parameters are all-gathered from the updated shards

ZeRO-1 keeps full gradient buckets (reduced once per step, after the last micro-batch);
ZeRO-2 keeps only its gradient shard: a bucket's buffer exists only while it is filled and
in flight, and is reduced every micro-batch (see gradient_buckets.py, [Note: rounds]).

Memory per rank between steps (Ψ padded to whole buckets of N*k; fp32 AdamW; + 4 bytes per
bucket for the optimizer's step counter): ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + 4Ψ/N + 8Ψ/N;
bf16: 2Ψ + 2Ψ + 12Ψ/N and 2Ψ + 2Ψ/N + 12Ψ/N (K = 12: master weights and two moments).

[Note: parameters nobody used]
A parameter that got no gradient on any rank in a step is skipped by a one-process
optimizer (its .grad is None). A flat shard is stepped whole, so its elements, and their
optimizer states, are put back after the step. (The shard's step counter still advances: an
Adam parameter skipped in some steps gets the shard's bias correction, as in every
flat-parameter implementation.)
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.optim_state import flat_state_by_name
from meshtrain.core.plan import Plan
from meshtrain.strategies.shared.buckets import Bucket, build_buckets
from meshtrain.strategies.shared.flat import (FlatLayout, flatten_into_buckets, keep_unstepped,
                                              parameter_groups)
from meshtrain.strategies.shared.gradient_buckets import GradientBuckets
from meshtrain.strategies.shared.precision import COMPUTE_DTYPES, MasterWeights, cast_to
from meshtrain.strategies.shared.replicas import (ReplicaGroup, broadcast_tensors,
                                                  replica_groups)
from meshtrain.strategies.slots import GradientSync
from meshtrain.strategies.zero.offload import Offloader
from meshtrain.strategies.zero.state_rows import RowsOf, state_rows


class ZeRO(GradientSync):
    """Slots 3 and 4 for Plan(zero=1 | 2): sharded gradient sync and a sharded optimizer."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, plan: Plan,
                 shared: list[str] = (), axis: str = "dp", offload_dir=None,
                 replicas: dict[str, ReplicaGroup] | None = None,
                 chunks: list[nn.Module] = ()) -> None:
        """`replicas`: parameters replicated over a group smaller than dp (experts over
        their edp group), each in buckets of its own, reduced and sharded over that group.
        `chunks`: the modules this rank runs (an interleaved stage's chunks): each chunk's
        parameters are bucketed apart (see `backward_reaches`, `backward_done`)."""
        self.comm, self.axis, self.stage = comm, axis, plan.zero
        self._chunks = list(chunks)
        self.replicas = replicas = dict(replicas or {})
        self.n, rank = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
        elements = sum(p.numel() for _, p in named_params)
        # fp32 master, two moments, ZeRO-3's shard: at most 16 bytes per element of a shard
        self.offload = Offloader(plan.offload, comm.mesh.device, offload_dir,
                                 16 * (elements // self.n + 1), comm.mesh.rank)
        if not any(p.is_meta for _, p in named_params):   # else made equal by construction
            broadcast_tensors([p for n, p in named_params if n not in replicas]
                              + list(buffers), comm, axis)
            for n, p in named_params:
                if n in replicas:
                    broadcast_tensors([p], replicas[n].comm, replicas[n].axis)
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self.params = list(self.named.values())
        names = {id(p): n for n, p in self.named.items()}
        # bf16 under mixed precision; else the model's own dtype (a float64 model stays so)
        compute = (COMPUTE_DTYPES[plan.precision] if plan.precision != "fp32"
                   else self.params[0].dtype)
        self.buckets = self._make_buckets(plan, compute, shared)
        self._group_of = {b.index: replicas.get(names[id(b.params[0])]) for b in self.buckets}
        self.layout = FlatLayout(self.buckets, names, self.n, rank, splits={
            i: (g.comm.mesh.size(g.axis), g.rank) for i, g in self._group_of.items() if g})
        self.masters = self._make_storage(plan.precision, compute)
        cast_to(plan.precision, [], list(buffers))
        # ZeRO-1: the gradient shard is this rank's chunk of its (persistent) bucket;
        # ZeRO-2/3: a tensor of its own, the only gradients kept between micro-batches
        self.grad_shards = (self.layout.my_shards([b.buffer for b in self.buckets])
                            if self.stage == 1 else
                            [torch.zeros(self.layout.shard_size(b.index), dtype=compute,
                                         device=b.device) for b in self.buckets])
        self.each_microbatch = self._reduces_each_microbatch(plan)
        self.grads = GradientBuckets(self.params, self.buckets, self._launch,
                                     scale=1.0 / self.n, launch_in_no_sync=self.each_microbatch,
                                     in_flight=2)
        self._reduced: set[int] = set()   # buckets reduce-scattered this step (ZeRO-2 adds to them)
        self._skipped: list[str] = []
        self._stepped: set[str] = set()   # parameters the optimizer has stepped, ever
        self.zero_grad()

    def _reduces_each_microbatch(self, plan: Plan) -> bool:
        """Whether a round is a micro-batch (ZeRO-2) or the step: see [Note: rounds]."""
        return self.stage >= 2

    def _make_buckets(self, plan: Plan, compute: torch.dtype, shared) -> list[Bucket]:
        """Buckets of about Plan.bucket_mb, in backward order; shared weights on their own."""
        dense = [p for n, p in self.named.items() if n not in self.replicas]
        groups = replica_groups(self.named, self.replicas) + parameter_groups(
            dense, [self.named[s] for s in shared if s in self.named],
            self._chunks)
        return build_buckets([], plan.bucket_mb * 2**20, pad_to=self.n, dtype=compute,
                             lazy=self.stage == 2, groups=groups)

    def _make_storage(self, precision: str, compute: torch.dtype) -> MasterWeights:
        """Whole parameters in flat buffers (`data`, one per bucket); this rank's shard of
        each is what the optimizer steps."""
        master_dtype = torch.float32 if precision != "fp32" else compute
        fp32 = flatten_into_buckets(self.buckets, master_dtype)
        self.data = fp32 if compute == master_dtype else flatten_into_buckets(self.buckets, compute)
        return self._masters(self.layout.my_shards(self.data), precision,
                             self.layout.my_shards(fp32))

    def _masters(self, compute: list[torch.Tensor], precision: str,
                 fp32: list[torch.Tensor]) -> MasterWeights:
        """The tensors the optimizer steps: where offload keeps them, when they are copies."""
        masters = MasterWeights(compute, precision, initial=fp32, device=self.offload.host)
        if masters.separate:
            for m in masters.masters:
                m.data = self.offload.place(m.detach())
        return masters

    @property
    def events(self) -> list[tuple[str, int, float]]:
        return self.grads.events

    # ---- the step (slot 3) ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.grads.start_step()
        self._reduced.clear()

    @contextmanager
    def no_sync(self):
        """ZeRO-1: accumulate in the buckets without communicating. ZeRO-2: each micro-batch
        is its own round, reduced into the gradient shard as it ends."""
        try:
            with self.grads.paused():
                yield
        finally:
            if self.each_microbatch:
                self._end_round()

    def _end_round(self) -> None:
        self.grads.flush()
        self.grads.wait()
        self.grads.start_round()

    def backward_reaches(self, params: list[nn.Parameter]) -> None:
        """ZeRO-2: gradient_buckets.py, [Note: a round's reach]."""
        if self.each_microbatch:
            self.grads.start_round(self.grads.holding(params))

    def backward_done(self, params: list[nn.Parameter]) -> None:
        """ZeRO-1, ZeRO-3 kept under stages: gradient_buckets.py, [Note: a chunk done]."""
        if not self.each_microbatch:
            self.grads.launch_done(self.grads.holding(params))

    def _launch(self, bucket: Bucket):
        target = self.grad_shards[bucket.index]
        first = bucket.index not in self._reduced
        self._reduced.add(bucket.index)
        return _ReduceScatter(*self._where(bucket.index), bucket, target,
                              accumulate=self.stage >= 2 and not first,
                              release=self.stage >= 2)

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Reduce what is left, and the step's statistics (loss, used flags) in one small
        all-reduce behind the gradients; returns the dp-mean loss."""
        self.grads.flush()
        stats = torch.cat([local_loss.reshape(1).float(), self.grads.used_flags()])
        self.comm.all_reduce(stats, self.axis, tag="step")
        self.grads.wait()
        loss, *used_by = stats.tolist()   # one host sync: the loss and the flags
        self._skipped = [n for (n, p), users in zip(self.named.items(), used_by) if not users]
        self._stepped.update(n for (n, _), users in zip(self.named.items(), used_by) if users)
        return loss / self.n

    # ---- the optimizer (slot 4) ---------------------------------------------------------------
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's shards only (one flat tensor per bucket):
        any optimizer whose state is per element works unchanged."""
        self.optimizer = factory(self.masters.masters)
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("ZeRO steps flat shards that cut through parameters: the "
                             "optimizer must put them all in one parameter group")
        return self.optimizer

    def step(self) -> None:
        self.masters.set_grads(self.grad_shards)
        # see [Note: parameters nobody used]
        with keep_unstepped(self.layout, self._skipped, self.masters.masters, self.optimizer):
            self.optimizer.step()
        self.masters.write_back()
        self.offload.after_step(self.optimizer)
        self._gather_updated()

    def _gather_updated(self) -> None:
        """Every bucket's whole parameters from the updated shards (each shard is its own
        place in the gathered output: NCCL gathers in place, gloo copies it out first)."""
        shards = self.layout.my_shards(self.data)
        handles = [comm.all_gather(flat, shard, axis, tag="param", async_op=True)
                   for (comm, axis), flat, shard in zip(map(self._where, range(len(shards))),
                                                        self.data, shards)]
        for h in handles:
            h.wait()

    def _where(self, bucket: int) -> tuple[Comm, str]:
        """The group bucket `bucket` is reduced and sharded over: dp, or its replicas'."""
        group = self._group_of[bucket]
        return (self.comm, self.axis) if group is None else (group.comm, group.axis)

    # ---- after the sync: other axes, clipping -------------------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return self.layout.shard_view(self.grad_shards, name)

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        """Each rank counts its own shard of every counted parameter."""
        total = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        for name in self.named:
            if counted(name):
                total += self.reduced_gradient(name).double().square().sum()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for g in self.grad_shards:
            g.mul_(factor.to(g.dtype))

    # ---- state --------------------------------------------------------------------------------
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters by name: the exact values (the fp32 masters, gathered, in bf16)."""
        return {name: t for i in range(len(self.buckets))
                for name, t in self._bucket_parameters(i).items()}

    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        """Per-parameter states, whole along dp: per-element states gathered and cut per
        parameter, a 0-dim state (Adam's step) copied to each."""
        state: dict[str, dict] = {}
        for i in range(len(self.buckets)):
            state.update(self._bucket_optimizer_state(i))
        return flat_state_by_name(self.optimizer, state, self._stepped, list(self.named))

    def state_rows(self, rows_of: RowsOf):   # a checkpoint's rows, no bucket gathered whole
        return state_rows(self, rows_of)

    def optimizer_groups(self) -> list[dict]:
        return flat_state_by_name(self.optimizer, {}, set(), list(self.named))[1]

    def _bucket_parameters(self, i: int) -> dict[str, torch.Tensor]:
        if not self.masters.mixed and self.stage < 3:   # whole on every rank already
            return {p.name: self.named[p.name].detach() for p in self.layout.pieces
                    if p.bucket == i}
        return self._whole(i, self.masters.masters[i].detach())

    def _bucket_optimizer_state(self, i: int) -> dict[str, dict]:
        master = self.masters.masters[i]
        state: dict[str, dict] = {p.name: {} for p in self.layout.pieces if p.bucket == i}
        for key, value in self.optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == master.shape:
                for name, t in self._whole(i, value).items():
                    state[name][key] = t.clone()
            else:
                for name in state:
                    state[name][key] = value.clone() if isinstance(value, torch.Tensor) else value
        return state

    def _whole(self, i: int, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bucket i's per-parameter tensors from every rank's `shard` of it (an all-gather)."""
        flat = self.layout.gather([shard], *self._where(i))[0]
        return {p.name: flat[p.start:p.start + p.numel].view(p.shape)
                for p in self.layout.pieces if p.bucket == i}

    @torch.no_grad()
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        if self.stage < 3:   # whole parameters live on every rank
            for name, p in self.named.items():
                p.copy_(params[name])
        self.masters.load(self.layout.shards_of(params, self.masters.masters[0].dtype,
                                                self.comm.mesh.device))
        self.zero_grad()
        if optimizer_state is not None:
            self._load_optimizer(*optimizer_state)
            self._stepped = set(optimizer_state[0]) & set(self.named)

    def flat_regions(self, name: str) -> tuple[tuple[int, int] | None, tuple[int, int]]:
        """ZeRO-1/2 keep whole parameters; every stage keeps its shard of the states."""
        owned = self.layout.owned_range(name)
        return (owned if self.stage == 3 else None), owned

    def _load_optimizer(self, state: dict[str, dict], groups: list[dict]) -> None:
        keys = {k for s in state.values() for k in s}
        out: dict[int, dict] = {i: {} for i in range(len(self.buckets))}
        for key in sorted(keys):
            first = next(s[key] for s in state.values() if key in s)
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                given = {n: state[n][key] for n in self.named if key in state.get(n, {})}
                shards = self.layout.shards_of(given, self.masters.masters[0].dtype,
                                               self.comm.mesh.device)
                for i, shard in enumerate(shards):   # fresh tensors: kept as they are
                    out[i][key] = shard
            else:   # one value per bucket: its first parameter's (all equal when ZeRO saved)
                for i in range(len(self.buckets)):
                    name = next(p.name for p in self.layout.pieces if p.bucket == i)
                    value = state.get(name, {}).get(key, first)
                    out[i][key] = value.clone() if isinstance(value, torch.Tensor) else value
        saved = next((g for g in groups if set(g["params"]) & set(self.named)), groups[0])
        hyper = {k: v for k, v in saved.items() if k != "params"}
        self.optimizer.load_state_dict({
            "state": {i: s for i, s in out.items() if s},
            "param_groups": [{**hyper, "params": list(range(len(self.buckets)))}]})

    # ---- accounting ---------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes held in memory by kind; what offload put on disk apart."""
        gradients = storage_bytes([b.buffer for b in self.buckets if b.buffer is not None])
        if self.stage >= 2:
            gradients += storage_bytes(self.grad_shards)
        optimizer = optimizer_state_tensors(self.optimizer)
        if self.masters.separate:
            optimizer += self.masters.masters
        on_disk = self.offload.offloaded_bytes(optimizer)
        out = {"parameters": self.parameter_bytes(), "gradients": gradients,
               "optimizer_states": storage_bytes(optimizer) - on_disk, "offloaded": on_disk}
        if self.stage >= 2:   # buckets made as backward fills them, freed once scattered
            out["gradients_in_flight"] = self.grads.buffers_peak
        return out

    def parameter_bytes(self) -> int:
        return storage_bytes(self.data)

    def pinned_buffers(self) -> list[torch.Tensor]:
        return self.offload.pinned_buffers(self.optimizer, self._placed_tensors())

    def _placed_tensors(self) -> list[torch.Tensor]:
        """What this sync keeps where offload puts things: the masters, their gradients'
        host buffers."""
        return self.masters.masters + self.masters.grad_buffers()

    def close(self) -> None:
        """Remove what offload wrote to disk."""
        self.offload.close()

    @property
    def padded_numel(self) -> int:
        """Ψ padded: the total length of the buckets (a multiple of N each)."""
        return sum(self.layout.lengths)

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()


class _ReduceScatter:
    """A bucket's reduce-scatter in flight: this rank's k elements of the sum, taken in fp32,
    land in `target` (overwritten, or added to when `accumulate`); the bucket's buffer is
    dropped afterwards when `release` (ZeRO-2)."""

    def __init__(self, comm: Comm, axis: str, bucket: Bucket, target: torch.Tensor,
                 accumulate: bool, release: bool) -> None:
        self.bucket, self.target, self.accumulate, self.release = bucket, target, accumulate, release
        # the sums land in the target itself where nothing is to be added or rounded
        wide = torch.promote_types(target.dtype, torch.float32)   # sums in fp32 at least
        direct = target.dtype == wide and not accumulate
        self.summed = target if direct else torch.empty(target.shape, dtype=wide,
                                                        device=target.device)
        self.work = comm.reduce_scatter(self.summed, bucket.buffer, axis, tag="grad",
                                        async_op=True)

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        if self.accumulate:
            self.target.add_(self.summed)
        elif self.summed is not self.target:
            self.target.copy_(self.summed)
        if self.release:
            self.bucket.release()
