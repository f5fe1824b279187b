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
    writes: frozenset        # storages it writes (in place, or creates)
    reads: frozenset         # storages of its tensor arguments
    random: bool             # draws from the RNG


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
        arguments = [a for a in func._schema.arguments]
        written = {r.storage for a, r in zip(arguments, args_spec)
                   if isinstance(r, _Ref) and a.alias_info is not None and a.alias_info.is_write}
        written |= {r.storage for r in _refs_in(outputs)}
        self.ops.append(_Op(func, args_spec, kwargs_spec, outputs, overwrites,
                            frozenset(written), frozenset(r.storage for r in _refs_in(
                                (args_spec, kwargs_spec))), _draws(name)))
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

    def _lifetimes(self, kept: list[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Over the ops `kept`: after each, the storages whose current value is dead (the
        next op to touch them overwrites them whole, or none does), and each storage's last."""
        touches: dict[int, list[int]] = {}
        for i in kept:
            for sid in self.ops[i].reads | self.ops[i].writes:
                touches.setdefault(sid, []).append(i)
        dead_after: dict[int, list[int]] = {}
        for sid, ts in touches.items():
            for i, j in zip(ts, ts[1:] + [None]):
                if j is None or self.ops[j].overwrites == sid:
                    dead_after.setdefault(i, []).append(sid)
        return dead_after, {sid: ts[-1] for sid, ts in touches.items()}

    def _needed(self, wanted: set[str]) -> list[int]:
        """The ops the final values of `wanted` depend on (a backward slice); every op if
        one of them draws random numbers, whose place in the RNG stream the others fix."""
        needed = {self.names[n].storage for n in wanted if n in self.names}
        kept = []
        for i in reversed(range(len(self.ops))):
            op = self.ops[i]
            if op.writes & needed:
                if op.random:
                    return list(range(len(self.ops)))
                kept.append(i)
                needed -= op.writes - op.reads if op.overwrites is None else {op.overwrites}
                needed |= op.reads - ({op.overwrites} if op.overwrites is not None else set())
        return kept[::-1]

    def tensors(self, device: torch.device | str = "cpu", wanted: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, value) for every parameter and buffer (or those `wanted`), each the value
        an eager build on this RNG state gives it, in the order the build finished them;
        values computed on `device` (the CPU for an eager CPU build's numbers). A whole
        replay leaves the global RNG where the eager build leaves it."""
        device = torch.device(device)
        kept = list(range(len(self.ops))) if wanted is None else self._needed(wanted)
        dead_after, last_touch = self._lifetimes(kept)
        names_of: dict[int, list[str]] = {}
        for name, ref in self.names.items():
            if wanted is None or name in wanted:
                names_of.setdefault(ref.storage, []).append(name)
        storages: dict[int, torch.UntypedStorage] = {}
        torch.set_rng_state(self.rng_state)
        for i in kept:
            op = self.ops[i]
            for sid in op.reads:
                if sid not in storages and sid not in self.constants:
                    storages[sid] = torch.UntypedStorage(self.nbytes[sid], device=device)
            real = lambda x: _view(x, storages, self.constants) if isinstance(x, _Ref) else (
                device if isinstance(x, torch.device) and x == META else x)
            out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
            _adopt(op.outputs, out, storages)
            for sid in dead_after.get(i, ()):
                if last_touch[sid] == i:
                    for name in names_of.get(sid, ()):
                        yield name, _view(self.names[name], storages, self.constants)
                storages.pop(sid, None)
        for sid, names in names_of.items():   # never touched by the build: uninitialised
            if sid not in last_touch:
                for name in names:
                    yield name, _view(self.names[name], {sid: torch.UntypedStorage(
                        self.nbytes[sid], device=device)}, self.constants)


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
    return attach_source(model, InitRecording(recorder, model, rng_state))


def attach_source(model: nn.Module, source) -> nn.Module:
    """`model` (on the meta device) takes its values from `source` (its recording, or a
    folder read tensor by tensor: models/pretrained.py) where the Trainer makes it real."""
    model._meshtrain_init = source
    return model


def source_of(model: nn.Module):
    """Where a model on the meta device takes its values (None: nowhere said)."""
    return getattr(model, "_meshtrain_init", None)


def recording_of(model: nn.Module) -> InitRecording | None:
    """The model's recorded build, whatever source it was given since."""
    source = source_of(model)
    return getattr(source, "recording", source) if source is not None else None


def is_on_meta(model: nn.Module) -> bool:
    return any(t.device == META for t in [*model.parameters(), *model.buffers()])


def _is_factory(func, args, kwargs) -> bool:
    """An op that makes a tensor from no tensor (empty, zeros, arange...)."""
    has_device = any(a.name == "device" for a in func._schema.arguments)
    tensors: list = []
    tree_map(lambda x: tensors.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
    return has_device and not tensors


def _refs_in(tree) -> list[_Ref]:
    found: list[_Ref] = []
    tree_map(lambda x: found.append(x) if isinstance(x, _Ref) else None, tree)
    return found


def _draws(name: str) -> bool:
    """Whether an aten op of this name draws from the RNG."""
    return any(word in name for word in ("rand", "normal", "uniform", "bernoulli", "multinomial",
                                         "dropout", "exponential", "geometric", "cauchy"))


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
