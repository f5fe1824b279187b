"""DiLoCo and local SGD: workers step alone, and agree every H steps (slots 3 and 4).

DiLoCo (Douillard et al. 2023). Each of the N dp workers starts a round from the same
anchor parameters θ and takes H inner steps alone with its own optimizer (the user's, e.g.
AdamW) on its own data, reaching θ_i. Then the workers average their pseudo-gradients

    Δ = (1/N) Σ_i (θ − θ_i)          one all-reduce of the parameters' size over dp

and an outer SGD with Nesterov momentum steps the anchor with Δ as its gradient:
θ ← OuterSGD(θ, Δ; outer_lr, outer_momentum). Every worker starts the next round from it.
The dp axis carries DDP's per-step gradient bytes once per H steps, plus the loss of the
sync step (one scalar): between syncs a step returns this worker's own loss, since a round
trip per step is what a slow link cannot afford (and the workers' models differ then).

Warm-up (`Plan.sync_warmup_steps` = K): the first K steps average whole gradients every
step, as DDP does (one all-reduce of the gradients, the loss and the used flags), and the
first round starts from the parameters at step K, as the paper starts from a DDP-trained
model.

Local SGD (periodic model averaging) is the case outer_lr = 1, no momentum: θ ← mean θ_i.
With H = 1, outer_lr = 1 and no momentum, both are DDP exactly (up to fp32 round-off).

Where the state lives: the inner optimizer's state is per worker (each worker's own moments);
the outer state (anchor θ and the outer momentum) is replicated on every dp rank, since every
rank computes the same outer step from the same averaged Δ (no extra bytes, N copies).
Across tp and pp each rank holds the outer state of the slices and stages it holds.

Checkpoints: the optimizer state of each parameter holds the anchor, the outer momentum, the
inner step count since the last sync, and every worker's inner state and parameters under
"worker<r>_<key>" (gathered over dp when saving), so a run resumes exactly whatever the step
it stopped at; scalar inner states (AdamW's step) are equal on every worker and kept once.
A round resumed under another sync_every H' ends once it has lasted H' steps (at its next
step, when it already has). Another dp_mode's checkpoint starts a round from its
parameters, every worker with its optimizer state; a dp_mode that keeps one replica takes
this state at a sync only (`one_replica_state`).
"""
from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.memory import optimizer_state_tensors, storage_bytes
from meshtrain.core.optim_state import load_state_by_name, param_groups_by_name, state_by_name
from meshtrain.core.plan import Plan, PlanError
from meshtrain.strategies.shared.replicas import broadcast_tensors
from meshtrain.strategies.slots import GradientSync

_SINCE_SYNC = "diloco_since_sync"
_WORKER_KEY = re.compile(r"worker(\d+)_")
_OUTER = ("diloco_anchor", "diloco_momentum")


class DiLoCo(GradientSync):
    """Gradient sync that does not sync gradients: H local steps, then an outer step on the
    averaged pseudo-gradient (see the module's docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]],
                 buffers: list[torch.Tensor], comm: Comm, plan: Plan, axis: str = "dp") -> None:
        self.comm, self.axis = comm, axis
        broadcast_tensors([p for _, p in named_params] + list(buffers), comm, axis)
        self.named = {n: p for n, p in named_params if p.requires_grad}
        self._name_of = {id(p): n for n, p in self.named.items()}
        self.params = list(self.named.values())
        self.sync_every = plan.sync_every
        local_sgd = plan.dp_mode == "local-sgd"
        self.outer_lr = 1.0 if local_sgd else float(plan.outer_lr)
        self.outer_momentum = 0.0 if local_sgd else float(plan.outer_momentum)
        self.since_sync = 0
        self.warmup_steps, self.steps = plan.sync_warmup_steps, 0
        with torch.no_grad():
            self.anchors = [p.detach().clone() for p in self.params]
        # the outer optimizer steps the anchors; Nesterov where there is momentum
        self.outer = torch.optim.SGD(self.anchors, lr=self.outer_lr,
                                     momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        self.numel = sum(p.numel() for p in self.params)
        # the pseudo-gradient; in the warm-up, the gradients, the loss and the used flags
        self.flat = torch.empty(self.numel + 1 + len(self.params), dtype=self.params[0].dtype,
                                device=self.params[0].device)

    # ---- the step -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def no_sync(self):
        return nullcontext()   # inner steps never communicate gradients

    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """No gradient leaves the worker (but in the warm-up); the loss is averaged over
        dp at a sync step only: between syncs, this worker's own loss."""
        loss = local_loss.detach().reshape(1).float()
        if self.steps < self.warmup_steps:
            return self._average_gradients(loss)
        if self.since_sync + 1 < self.sync_every:
            return loss.item()
        loss = loss.clone()
        self.comm.all_reduce(loss, self.axis, tag="loss")
        return loss.item() / self.comm.mesh.size(self.axis)

    @torch.no_grad()
    def _average_gradients(self, loss: torch.Tensor) -> float:
        """A warm-up step: DDP's mean gradient, the global mean loss, and `.grad = None`
        for a parameter no rank used (as DDP leaves it), in one all-reduce."""
        n = self.comm.mesh.size(self.axis)
        views = self.flat[:self.numel].split([p.numel() for p in self.params])
        for view, p in zip(views, self.params):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        self.flat[self.numel] = loss
        self.flat[self.numel + 1:] = torch.tensor([p.grad is not None for p in self.params],
                                                  dtype=torch.float32, device=self.flat.device)
        self.flat[:self.numel].div_(n)
        self.comm.all_reduce(self.flat, self.axis, tag="grad")
        total, *users = self.flat[self.numel:].tolist()   # one host sync
        for view, p, used_by in zip(views, self.params, users):
            p.grad = view.view_as(p) if used_by else None
        return total / n

    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """The user's optimizer as each worker's inner optimizer, over its whole replica."""
        self.optimizer = factory(self.params)
        return self.optimizer

    def step(self) -> None:
        """The inner step; every `sync_every`-th, the outer step after it (after the
        warm-up, whose last step sets the anchors)."""
        self.optimizer.step()
        self.steps += 1
        if self.steps <= self.warmup_steps:
            if self.steps == self.warmup_steps:
                with torch.no_grad():
                    for anchor, p in zip(self.anchors, self.params):
                        anchor.copy_(p)
            return
        self.since_sync += 1
        # at least H: a round resumed under a smaller sync_every than it began with ends now
        if self.since_sync >= self.sync_every:
            self._outer_step()
            self.since_sync = 0

    @torch.no_grad()
    def _outer_step(self) -> None:
        """Δ = mean over workers of (anchor − θ_i), one all-reduce; the outer SGD steps the
        anchors with Δ; every worker continues from them."""
        n = self.comm.mesh.size(self.axis)
        flat = self.flat[:self.numel]
        views = flat.split([p.numel() for p in self.params])
        for view, anchor, p in zip(views, self.anchors, self.params):
            torch.sub(anchor.reshape(-1), p.reshape(-1), out=view)
        flat.div_(n)
        self.comm.all_reduce(flat, self.axis, tag="pseudo-grad")
        for view, anchor in zip(views, self.anchors):
            anchor.grad = view.view_as(anchor)
        self.outer.step()
        for anchor, p in zip(self.anchors, self.params):
            anchor.grad = None
            p.copy_(anchor)

    def resume_at(self, steps_done: int) -> None:
        self.steps = steps_done   # the round's position came back with the state

    # ---- after the inner backward: other axes, clipping ------------------------------------
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        return self.named[name].grad   # this worker's own gradient: nothing reduced over dp

    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        raise PlanError("max_grad_norm with dp_mode='diloco'/'local-sgd' is not built: each "
                        "worker would clip by its own norm; drop max_grad_norm")

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    # ---- state ----------------------------------------------------------------------------
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This worker's parameters: every worker's are equal right after a sync; between
        syncs each rank reports (and evaluates) its own worker's."""
        return {n: p.detach() for n, p in self.named.items()}

    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        """Inner and outer state by name; every worker's inner state and parameters gathered
        over dp (a collective along dp)."""
        names = {id(p): n for n, p in self.named.items()}
        inner = state_by_name(self.optimizer, names)
        outer = state_by_name(self.outer, {id(a): self._name_of[id(p)]
                                           for a, p in zip(self.anchors, self.params)})
        state = {}
        for anchor, (name, p) in zip(self.anchors, self.named.items()):
            mine = {"param": p.detach(), **inner.get(name, {})}
            entry = {_OUTER[0]: anchor.detach().clone(),
                     _SINCE_SYNC: torch.tensor(self.since_sync, device=anchor.device)}
            if outer.get(name, {}).get("momentum_buffer") is not None:
                entry[_OUTER[1]] = outer[name]["momentum_buffer"].clone()
            for key, value in mine.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    for r, each in enumerate(self._gather(value)):
                        entry[f"worker{r}_{key}"] = each
                else:   # scalars (a step count): equal on every worker, kept once
                    entry[f"worker_{key}"] = value
            state[name] = entry
        return state, param_groups_by_name(self.optimizer, names)

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        n = self.comm.mesh.size(self.axis)
        out = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self.comm.all_gather(out, tensor.contiguous().reshape(-1), self.axis, tag="checkpoint")
        return [chunk.view_as(tensor) for chunk in out.chunk(n)]

    @torch.no_grad()
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        """Take this worker's parameters and inner state, and the outer state; a state saved
        by another dp_mode starts a round from `params`, every worker with its optimizer
        state."""
        r, n = self.comm.mesh.axis_rank(self.axis), self.comm.mesh.size(self.axis)
        state = optimizer_state[0] if optimizer_state is not None else {}
        inner, outer, since = {}, {}, set()
        for anchor, (name, p) in zip(self.anchors, self.named.items()):
            saved = state.get(name, {})
            workers = {int(m.group(1)) for m in map(_WORKER_KEY.match, saved) if m}
            if workers and workers != set(range(n)):
                raise PlanError(f"this checkpoint's DiLoCo state is for another number of "
                                f"dp workers than dp={n}; resume with the dp it was saved with")
            prefix = f"worker{r}_"
            p.copy_(saved.get(prefix + "param", params[name]))
            anchor.copy_(saved.get(_OUTER[0], params[name]))
            if workers:
                inner[name] = {k[len(prefix):]: v for k, v in saved.items()
                               if k.startswith(prefix) and k != prefix + "param"}
                inner[name].update({k[7:]: v for k, v in saved.items()
                                    if k.startswith("worker_")})
            else:   # another dp_mode's one optimizer state: every worker starts from it
                inner[name] = {k: v for k, v in saved.items() if not k.startswith("diloco_")}
            if _OUTER[1] in saved and self.outer_momentum > 0:   # local SGD has none
                outer[name] = {"momentum_buffer": saved[_OUTER[1]].clone()}
            since.add(int(saved.get(_SINCE_SYNC, 0)))
        self.since_sync = since.pop() if len(since) == 1 else 0
        self.zero_grad()
        if optimizer_state is not None:
            inner = {k: v for k, v in inner.items() if v}
            load_state_by_name(self.optimizer, self.named, inner, optimizer_state[1])
            by_name = dict(zip(self.named, self.anchors))
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": list(by_name)} for g in self.outer.param_groups]
            load_state_by_name(self.outer, by_name, outer, groups)

    # ---- accounting ---------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Inner states, plus the outer ones (anchors, momentum) and the sync buffer."""
        grads = [p.grad for p in self.params if p.grad is not None]
        outer = storage_bytes(self.anchors + optimizer_state_tensors(self.outer) + [self.flat])
        return {"parameters": storage_bytes(self.params), "gradients": storage_bytes(grads),
                "optimizer_states": storage_bytes(optimizer_state_tensors(self.optimizer))
                + outer}


def one_replica_state(optimizer_state: dict, mode: str, saved_mode: str | None) -> dict:
    """A diloco / local-sgd checkpoint's optimizer state as one optimizer's (what a dp_mode
    keeping one replica loads); any other state as it is.

    Only at a sync (or in the warm-up) do the workers hold the same parameters: there, each
    per-element inner state is the mean over the workers, and the outer anchor (equal to the
    parameters) and momentum are dropped. The mean is exact for a state linear in the
    gradients (SGD's momentum, Adam's first moment) where local SGD is DDP (H = 1); Adam's
    second moment of each worker's own gradient is at least that of their mean, so the first
    steps after are no larger than DDP's. Mid-round the workers' parameters differ: refused."""
    state = optimizer_state["state"]
    if not any(_OUTER[0] in s for s in state.values()):
        return optimizer_state
    since = max(int(s.get(_SINCE_SYNC, 0)) for s in state.values())
    if since:
        saved = repr(saved_mode) if saved_mode else "'diloco' or 'local-sgd'"
        raise PlanError(f"this checkpoint was saved by dp_mode={saved} {since} inner step(s) "
                        f"after its last sync: its workers' parameters differ, and "
                        f"dp_mode={mode!r} keeps one replica; resume it under dp_mode="
                        f"{saved}, or load into dp_mode={mode!r} a checkpoint saved at a sync "
                        f"(a multiple of sync_every steps after the warm-up)")
    merged = {}
    for name, saved_state in state.items():
        workers = sorted({int(m.group(1)) for m in map(_WORKER_KEY.match, saved_state) if m})
        one = {k[len("worker_"):]: v for k, v in saved_state.items() if k.startswith("worker_")}
        keys = {k[len(f"worker{workers[0]}_"):] for k in saved_state
                if workers and k.startswith(f"worker{workers[0]}_")} - {"param"}
        for key in sorted(keys):
            each = torch.stack([saved_state[f"worker{r}_{key}"] for r in workers])
            one[key] = each.mean(dim=0) if each.is_floating_point() else each[0]
        if one:
            merged[name] = one
    return {**optimizer_state, "state": merged}
