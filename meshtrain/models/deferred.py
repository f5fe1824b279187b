"""Models described before they exist: built on the meta device, their initialisation recorded,
then replayed one tensor at a time, so that no process ever holds the whole model.

    model = build_on_meta(lambda: GPT(config))     # no memory: every tensor on "meta"
    for name, value in recording_of(model).tensors(device="cpu"):
        ...                                         # the value an eager build gives `name`

[Note: replaying the build]
An eager build draws every random number from torch's global RNG in one order: each
module's own reset_parameters as it is constructed, then the model's init pass. A rank that
keeps a slice of the model must still draw them all, in that order, or its slice would not
equal the eager build's. So the build runs once on the meta device under a dispatch mode that
records every operation (factories, random fills, views, copies, arithmetic), naming each
tensor by its storage and view. Replaying the operations on the CPU from the RNG state the
build started from redraws exactly the numbers the eager build draws. Liveness keeps the
transient small: a storage exists from the first operation that writes it until its last
reference, and a value that is wholly overwritten before anything reads it (a Linear's
default init, redone by the model's own) is drawn into a buffer dropped at once. A model
tensor is handed out when its storage is last referenced: at most a few tensors are alive at
any time, never the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

META = torch.device("meta")

# in-place operations that overwrite every element of their first argument, reading none
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "copy_", "bernoulli_", "random_",
               "exponential_", "geometric_", "log_normal_", "cauchy_"}


class DeferredInitError(RuntimeError):
    """A model that cannot be built on the meta device (its construction reads values)."""


@dataclass(frozen=True)
class _Ref:
    """A tensor as a view of a recorded storage."""
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def covers(self, nbytes: int) -> bool:
        numel = 1
        for s in self.shape:
            numel *= s
        contiguous = self.stride == _contiguous_stride(self.shape)
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == nbytes


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    outputs: object
    overwrites: int | None   # the storage this op wholly overwrites, if any


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.nbytes: dict[int, int] = {}       # storage id -> bytes
        self.created: set[int] = set()         # storages some recorded op made
        self.constants: dict[int, torch.Tensor] = {}   # real tensors made before recording
        self._alive: list[torch.Tensor] = []   # keeps storage ids from being reused

    def ref(self, t: torch.Tensor, made: bool = False) -> _Ref:
        storage = t.untyped_storage()
        sid = storage._cdata
        if sid not in self.nbytes:
            self.nbytes[sid] = storage.nbytes()
            self._alive.append(t)
            if made:
                self.created.add(sid)
            else:
                self.constants[sid] = t
        return _Ref(sid, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_factory(func, args, kwargs):   # made on the meta device, whatever it asked
            kwargs = {**kwargs, "device": META}
        spec = lambda x: self.ref(x) if isinstance(x, torch.Tensor) else x
        args_spec, kwargs_spec = tree_map(spec, args), tree_map(spec, kwargs)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            raise DeferredInitError(
                f"the model's construction runs {func} on values, which the meta device "
                f"does not have ({str(exc).splitlines()[0]}): build it eagerly instead") from None
        outputs = tree_map(lambda x: self.ref(x, made=True) if isinstance(x, torch.Tensor)
                           else x, out)
        overwrites = None
        name = func.overloadpacket.__name__
        first = args_spec[0] if args_spec else None
        if name in _OVERWRITES and isinstance(first, _Ref) and first.covers(
                self.nbytes[first.storage]):
            overwrites = first.storage
        self.ops.append(_Op(func, args_spec, kwargs_spec, outputs, overwrites))
        return out


class InitRecording:
    """The operations a model's build made, replayable one storage at a time."""

    def __init__(self, recorder: _Recorder, model: nn.Module, rng_state: torch.Tensor) -> None:
        self.ops, self.nbytes = recorder.ops, recorder.nbytes
        self.constants = recorder.constants
        self.rng_state = rng_state
        self.names: dict[str, _Ref] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            self.names[name] = recorder.ref(t.detach())
        self._plan_lifetimes()

    def _plan_lifetimes(self) -> None:
        """For each op, the storages whose current value is dead after it: the next op to
        touch them overwrites them whole, or none does (then model tensors are handed out)."""
        touches: dict[int, list[int]] = {}
        for i, op in enumerate(self.ops):
            for sid in {r.storage for r in _refs(op)}:
                touches.setdefault(sid, []).append(i)
        self.dead_after: list[list[int]] = [[] for _ in self.ops]
        self.last_touch = {sid: ts[-1] for sid, ts in touches.items()}
        for sid, ts in touches.items():
            for i, j in zip(ts, ts[1:] + [None]):
                if j is None or self.ops[j].overwrites == sid:
                    self.dead_after[i].append(sid)
        self.names_of: dict[int, list[str]] = {}
        for name, ref in self.names.items():
            self.names_of.setdefault(ref.storage, []).append(name)

    def tensors(self, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, value) for every parameter and buffer, each the value an eager build on
        this RNG state gives it, in the order the build finished them; values computed on
        `device` (the CPU for an eager CPU build's numbers). Leaves the global RNG where the
        eager build leaves it."""
        device = torch.device(device)
        storages: dict[int, torch.UntypedStorage] = {}
        torch.set_rng_state(self.rng_state)
        for i, op in enumerate(self.ops):
            for r in _refs(op, outputs=False):
                if r.storage not in storages and r.storage not in self.constants:
                    storages[r.storage] = torch.UntypedStorage(self.nbytes[r.storage], device=device)
            real = lambda x: _view(x, storages, self.constants) if isinstance(x, _Ref) else (
                device if isinstance(x, torch.device) and x == META else x)
            out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
            _adopt(op.outputs, out, storages)
            for sid in self.dead_after[i]:
                if self.last_touch[sid] == i:
                    for name in self.names_of.get(sid, ()):
                        yield name, _view(self.names[name], storages, self.constants)
                storages.pop(sid, None)
        for name, ref in self.names.items():   # never touched by the build: uninitialised
            if ref.storage not in self.last_touch:
                yield name, _view(ref, {ref.storage: torch.UntypedStorage(
                    self.nbytes[ref.storage], device=device)}, self.constants)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` run on the meta device with its operations recorded; the model it returns
    holds no memory and carries its recording (`recording_of`). The global RNG is left as
    it was: replaying the recording draws what the eager build would have drawn."""
    rng_state = torch.get_rng_state()
    recorder = _Recorder()
    # The factories are sent to the meta device by the recorder, not by torch.device("meta"):
    # under that context transformers skips its models' init pass, which the build must run.
    with recorder:
        model = build()
    torch.set_rng_state(rng_state)
    model._meshtrain_init = InitRecording(recorder, model, rng_state)
    return model


def recording_of(model: nn.Module) -> InitRecording | None:
    return getattr(model, "_meshtrain_init", None)


def is_on_meta(model: nn.Module) -> bool:
    return any(t.device == META for t in [*model.parameters(), *model.buffers()])


def _is_factory(func, args, kwargs) -> bool:
    """An op that makes a tensor from no tensor (empty, zeros, arange...)."""
    has_device = any(a.name == "device" for a in func._schema.arguments)
    tensors: list = []
    tree_map(lambda x: tensors.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
    return has_device and not tensors


def _refs(op: _Op, outputs: bool = True) -> list[_Ref]:
    found: list[_Ref] = []
    for tree in (op.args, op.kwargs, op.outputs) if outputs else (op.args, op.kwargs):
        tree_map(lambda x: found.append(x) if isinstance(x, _Ref) else None, tree)
    return found


def _view(ref: _Ref, storages: dict, constants: dict) -> torch.Tensor:
    if ref.storage in constants:
        return constants[ref.storage]
    t = torch.empty(0, dtype=ref.dtype, device=storages[ref.storage].device)
    return t.set_(storages[ref.storage], ref.offset, ref.shape, ref.stride)


def _adopt(spec, out, storages: dict) -> None:
    """Storages an op created (its outputs) become the recorded ones they stand for."""
    if isinstance(spec, _Ref):
        if isinstance(out, torch.Tensor) and spec.storage not in storages:
            storages[spec.storage] = out.untyped_storage()
        elif isinstance(out, torch.Tensor) and out.untyped_storage()._cdata != \
                storages[spec.storage]._cdata:
            storages[spec.storage] = out.untyped_storage()
    elif isinstance(spec, (list, tuple)):
        for s, o in zip(spec, out):
            _adopt(s, o, storages)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
