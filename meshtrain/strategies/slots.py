"""The five slots a Plan fills (ARCHITECTURE.md, "How a Plan becomes a training step"), as
the protocols every strategy implements, and the choice each slot makes when its axis has
size one. The Trainer calls them in this order, whatever the plan:

    1. shard layers     LayerSharding    tp   none | tensor parallel
    2. keep stages      Stages           pp   the whole model | pipeline stages
    3. sync gradients   GradientSync     dp   DDP | ZeRO | parameter server
    4. own optimizer    (GradientSync)   dp   per parameter | flat shards | on the server
    5. drive the step   StepDriver       pp   micro-batch loop | pipeline schedule

Every slot speaks in parameter names (the one-process model's, see core/state.py), so that
a strategy never needs to know which others surround it.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Iterator, Callable, ContextManager, Protocol

import torch
from torch import nn

from meshtrain.core.device import to_device
from meshtrain.core.plan import PlanError
from meshtrain.core.regions import Region, whole


class LayerSharding(Protocol):
    """Slot 1: which slice of each tensor this rank holds along tp."""

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor `name` (a parameter, or a state shaped like it) from every tp
        rank's slice. Collective over tp: every tp rank calls it for the same names."""

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor `name` (no communication)."""

    def region(self, name: str, shape: tuple[int, ...]) -> Region:
        """Which parts of the whole tensor `name` (of `shape`: a parameter, or a state
        shaped like it) make this rank's slice: what a checkpoint load reads of it."""

    def cuts(self, name: str, shape: tuple[int, ...]) -> list[list[int]]:
        """Per dim, where any rank's slice of the whole tensor `name` begins or ends: where
        a checkpoint cuts it into chunks ([] per dim: nowhere)."""

    def counts(self, name: str) -> bool:
        """Whether this rank counts `name` in a sum over tp ranks (a replicated tensor is
        counted on one tp rank only)."""

    def sum_partial_gradients(self, reduced: Callable[[str], torch.Tensor | None]) -> None:
        """After the dp sync: sum over tp the gradients each tp rank holds only a part of
        (LayerNorms under sequence parallel), in place in the views `reduced(name)` gives."""

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """The loss as this sharding computes it: the same function where outputs are whole;
        a vocab-parallel cross-entropy where the output layer's logits stay split over tp."""

    replicas: dict
    """Parameters replicated over fewer ranks than the dp axis, by name -> ReplicaGroup
    (strategies/shared/replicas.py): experts under expert parallel, over their edp group.
    The gradient sync reduces each over its group. Empty for every other sharding."""


class Stages(Protocol):
    """Slot 2: which layers this rank runs along pp."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters this rank holds, by canonical name, in model order."""

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers this rank holds, by canonical name."""

    def modules(self) -> list[nn.Module]:
        """The modules this rank runs (what a model on the meta device makes real)."""

    def merge(self, local: dict[str, object]) -> dict[str, object]:
        """Every stage's entries (name -> tensor or dict of tensors), on every rank.
        Collective over pp."""

    def counts(self, name: str) -> bool:
        """Whether this rank counts `name` in a sum over stages (a weight tied across
        stages is counted on its first holder only)."""

    shared: dict[str, list[int]]
    """Parameters held by several stages (tied weights): name -> the pp ranks holding it.
    The gradient sync lays these out identically on every holder."""

    def sum_shared_gradients(self, reduced: Callable[[str], torch.Tensor | None]) -> None:
        """After the dp sync: sum each shared parameter's gradient over the stages holding
        it, in place in the views `reduced(name)` gives, identically on every holder."""


class GradientSync(ABC):
    """Slots 3 and 4: how data-parallel replicas agree on gradients, and the optimizer that
    owns the update. The step driver calls, per step: `zero_grad`, then each micro-batch's
    backward (all but each stage's last inside `no_sync`), then `finish_gradient_sync`, then
    `step`.

    Every implementation subclasses this class. The abstract methods are required; the
    optional steps at the end (`settle`, `idle`, `close`, `step_driver`) default to what a
    synchronous, one-rank-per-replica sync needs (nothing), so callers call them always."""

    @abstractmethod
    def build_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def no_sync(self) -> ContextManager: ...

    def backward_reaches(self, params: list[nn.Parameter]) -> None:
        """The next backward reaches only `params` (one chunk of an interleaved stage): a
        sync that reduces every micro-batch may reduce only theirs. Default: nothing."""

    def backward_done(self, params: list[nn.Parameter]) -> None:
        """The step's backwards through `params` (one chunk of an interleaved stage) are
        over, before the step is: a sync that reduces once a step may start on theirs.
        Default: nothing."""

    @abstractmethod
    def finish_gradient_sync(self, local_loss: torch.Tensor) -> float:
        """Launch what is left, wait; return the mean of `local_loss` over dp."""

    @abstractmethod
    def reduced_gradient(self, name: str) -> torch.Tensor | None:
        """After `finish_gradient_sync`: this rank's part of the dp-reduced gradient of
        `name` (a view, to be summed in place over another axis), laid out identically on
        every rank that holds `name` at the same dp coordinate; None if it has none."""

    @abstractmethod
    def gradient_square_sum(self, counted: Callable[[str], bool]) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank owns along dp, over the
        parameters `counted` admits (float64, 0-dim)."""

    @abstractmethod
    def scale_gradients(self, factor: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self) -> None:
        """The optimizer step, and whatever makes the parameters whole again after it."""

    @abstractmethod
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name, whole along dp (a collective where they are
        sharded)."""

    @abstractmethod
    def local_optimizer_state(self) -> tuple[dict[str, dict], list[dict]]:
        """(state by parameter name, param groups by name), whole along dp."""

    forward_gathers = False
    """Whether a forward takes part in collectives over dp (ZeRO-3 gathers parameters)."""

    def local_state_groups(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, dict]]]:
        """(parameters, optimizer states) by name, whole along dp, a group at a time: what
        a checkpoint consolidates without holding the whole state at once. Collective where
        sharded: every dp rank gets the same groups in the same order."""
        yield self.local_parameters(), self.local_optimizer_state()[0]

    def state_rows(self, rows_of: Callable[[str, tuple[int, ...], int], list[tuple[int, int]]]
                   ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, dict]]] | None:
        """As `local_state_groups`, but of each parameter and each per-element state of it
        only this rank's rows, and a parameter's states may come in later pairs than it:
        rows_of(name, shape, bytes per element with its states) gives every dp rank's
        (first, last) of dim 0 (a 0-dim one: (0, 1) or none), each rank calling it for the
        same parameters in the same order. None (the default): not offered; the caller
        consolidates `local_state_groups` and cuts."""
        return None

    def optimizer_groups(self) -> list[dict]:
        """The optimizer's param groups by parameter name (as `local_optimizer_state`)."""
        return self.local_optimizer_state()[1]

    @abstractmethod
    def load_local(self, params: dict[str, torch.Tensor],
                   optimizer_state: tuple[dict[str, dict], list[dict]] | None) -> None:
        """Take this rank's parameters and their optimizer states: each whole along dp, or
        where `flat_regions` names a range, that range alone (flattened)."""

    def flat_regions(self, name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The element ranges of parameter `name` (flattened, as slot 1 slices it) this rank
        keeps: (of the parameter, of its optimizer states); None: all of it. Default: all."""
        return None, None

    @abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: "parameters", "gradients", "optimizer_states" (in memory);
        where they apply, "offloaded" (on disk) and "gathered_peak" (ZeRO-3)."""

    # ---- optional steps, with their defaults ----------------------------------------------
    def settle(self) -> None:
        """Finish every message in flight, before a collective that every rank enters at
        the same step (evaluation, a checkpoint). Default: nothing is ever left in flight
        (ps-async overrides it)."""

    def idle(self, seconds: float) -> None:
        """Spend `seconds` doing nothing useful for training (a straggler's delay). Default:
        sleep; a rank that serves others meanwhile (ps-async) overrides it."""
        time.sleep(seconds)

    def resume_at(self, steps_done: int) -> None:
        """After a checkpoint is loaded: the run has taken `steps_done` steps. Default:
        nothing depends on it (a sync with a warm-up phase overrides it)."""

    def close(self) -> None:
        """Release what outlives the trainer otherwise. Default: nothing to release (ZeRO's
        offload to disk overrides it)."""

    def pinned_buffers(self) -> list[torch.Tensor]:
        """The host tensors this sync keeps pinned beside a GPU, for the memory report.
        Default: none (ZeRO's offload to the host overrides it)."""
        return []

    def step_driver(self, loss_fn: Callable, microbatches: int,
                    device: torch.device) -> StepDriver | None:
        """Slot 5 where this sync dictates it: None (the default) leaves the choice to the
        plan's pp; a sync whose replicas are not ranks (master DP: threads of this process)
        returns the loop that runs them."""
        return None


class StepDriver(Protocol):
    """Slot 5: the order of forwards, backwards and communication in one step."""

    def run(self, inputs: torch.Tensor, targets: torch.Tensor,
            sync: GradientSync) -> torch.Tensor:
        """Forward and backward every micro-batch; this rank's loss sum (0 where no loss
        is computed), already divided by the number of micro-batches."""

    def global_loss(self, dp_mean: float) -> float:
        """The loss every rank returns, from the dp mean of this rank's loss."""

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss of one batch, without gradients, the same on every rank."""


# ---- each slot's choice when its axis has size one -------------------------------------------
class NoSharding:
    """Slot 1 with tp = 1: every rank holds whole tensors."""

    replicas: dict = {}

    def sum_partial_gradients(self, reduced) -> None:
        pass

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return local

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full

    def region(self, name: str, shape: tuple[int, ...]) -> Region:
        return whole(shape)

    def cuts(self, name: str, shape: tuple[int, ...]) -> list[list[int]]:
        return [[] for _ in shape]

    def counts(self, name: str) -> bool:
        return True

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        return loss_fn


class WholeSequences:
    """Slot 1's split of the batch with cp = 1: every rank takes whole sequences."""

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class WholeModel:
    """Slot 2 with pp = 1: this rank runs every layer."""

    shared: dict[str, list[int]] = {}

    def __init__(self, model: nn.Module, canonical: dict[str, str]) -> None:
        self.model = model
        self._canonical = canonical

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(self._canonical[n], p) for n, p in self.model.named_parameters()]

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        # non-persistent buffers (RoPE's inv_freq) are in no state dict: not ours to sync
        return [(self._canonical[n], b) for n, b in self.model.named_buffers()
                if n in self._canonical]

    def merge(self, local: dict[str, object]) -> dict[str, object]:
        return local

    def counts(self, name: str) -> bool:
        return True

    def sum_shared_gradients(self, reduced) -> None:
        pass   # tied weights within one stage: autograd already summed their gradients


class MicrobatchLoop:
    """Slot 5 with pp = 1: the micro-batches one after another, gradients accumulating
    without communication until the last (gradient accumulation)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, microbatches: int,
                 device: torch.device, activations=None,
                 forward_begins: Callable[[], None] = lambda: None) -> None:
        """`forward_begins` runs before each micro-batch's forward and each evaluation
        (compiled CUDA graphs: strategies/compile.py's `graph_step_marker`)."""
        self.model, self.loss_fn, self.microbatches = model, loss_fn, microbatches
        self.device, self.activations = device, activations
        self.forward_begins = forward_begins

    def run(self, inputs: torch.Tensor, targets: torch.Tensor,
            sync: GradientSync) -> torch.Tensor:
        micro_inputs = split_microbatches(inputs, self.microbatches)
        micro_targets = split_microbatches(targets, self.microbatches)
        loss_sum = torch.zeros((), device=self.device)
        last = len(micro_inputs) - 1
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            x, y = to_device(x, self.device), to_device(y, self.device)
            self.forward_begins()
            with (sync.no_sync() if i < last else nullcontext()):
                with (self.activations.measure() if self.activations else nullcontext()):
                    loss = self.loss_fn(self.model(x), y) / len(micro_inputs)
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def global_loss(self, dp_mean: float) -> float:
        return dp_mean

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.forward_begins()
        return float(self.loss_fn(self.model(to_device(inputs, self.device)),
                                  to_device(targets, self.device)))


def split_microbatches(batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """Split along dim 0 into equal micro-batches; refuse a split that is not exact."""
    if batch.shape[0] % microbatches:
        raise PlanError(f"this rank's batch of {batch.shape[0]} does not split into "
                        f"microbatches={microbatches}; use a per-rank batch that is a multiple "
                        f"of {microbatches}")
    return list(batch.chunk(microbatches))
