"""A model on the meta device made real where it is kept: each rank fills only the tensors its
slots keep (its tp slices, its pipeline stages, or, under ZeRO-3, its flat shards), one whole
tensor at a time, from a source of (name, whole tensor) pairs: a recorded build
(models/deferred.py) or a checkpoint read tensor by tensor (models/pretrained.py).

    source.tensors(device)  ->  (name, whole value)  ->  slot 1's slice  ->  the module's tensor
                                                                          or ZeRO-3's shard

The transient beyond what the rank keeps is the source's: one whole tensor (a recording may
hold a few at once while an operation reads several).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from meshtrain.core.state import StateLayout
from meshtrain.models.deferred import source_of

META = torch.device("meta")
TakeParameter = Callable[[str, torch.Tensor], None]


class TensorSource(Protocol):
    def tensors(self, device: torch.device | str = "cpu", wanted: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) for the model's tensors (at least those `wanted`)."""


class MaterialiseError(RuntimeError):
    """A source whose tensors do not fit the model (missing, wrong shape or dtype)."""


def init_source(model: nn.Module) -> TensorSource | None:
    """Where a model on the meta device takes its values (None: the model is real)."""
    if not any(t.device == META for t in [*model.parameters(), *model.buffers()]):
        return None
    source = source_of(model)
    if source is None:
        raise MaterialiseError(
            f"{type(model).__name__} is on the meta device with nothing to fill it from: "
            "build it with meshtrain.models.deferred.build_on_meta(lambda: ...) (the values "
            "an eager build gives) or load it with meshtrain.load_pretrained(path)")
    return source


def kept_meta_tensors(model: nn.Module, kept: Iterable[nn.Module]
                      ) -> dict[str, list[tuple[nn.Module, str, str]]]:
    """Every name (aliases included) of a meta tensor in the modules this rank keeps:
    name -> [(module, "_parameters" | "_buffers", key)]."""
    kept_ids = {id(m) for top in kept for m in top.modules()}
    targets: dict[str, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) not in kept_ids:
            continue
        for slot in ("_parameters", "_buffers"):
            for key, t in getattr(module, slot).items():
                if t is not None and t.device == META:
                    name = f"{prefix}.{key}" if prefix else key
                    targets.setdefault(name, []).append((module, slot, key))
    return targets


@torch.no_grad()
def materialise(model: nn.Module, kept: Iterable[nn.Module], layout: StateLayout,
                sharding, source: TensorSource, device: torch.device,
                take_parameter: TakeParameter | None = None) -> None:
    """Fill every meta tensor of the `kept` modules from `source`: slot 1's (`sharding`'s)
    slice of each
    whole tensor, copied to `device`. With `take_parameter` (ZeRO-3), parameters go to it
    (by canonical name, as slices) and stay as they are; buffers are filled either way."""
    targets = kept_meta_tensors(model, kept)
    done: set[int] = set()
    for name, whole in source.tensors("cpu", wanted=set(targets)):
        for module, slot, key in targets.pop(name, ()):
            current = getattr(module, slot)[key]
            if id(current) in done:
                continue   # a tied tensor, filled under its first name
            canonical = layout.canonical.get(name, name)   # non-persistent buffers: unsplit
            local = sharding.local(canonical, whole) if canonical in layout.shapes else whole
            _check(name, local, current)
            done.add(id(current))
            if slot == "_parameters" and take_parameter is not None:
                take_parameter(canonical, local)
                continue
            value = local.to(device=device, dtype=current.dtype, copy=True)
            if isinstance(current, nn.Parameter):
                value = nn.Parameter(value, requires_grad=current.requires_grad)
            # in place: the slots hold these tensors by identity (a meta tensor's .data
            # cannot take a real one)
            torch.utils.swap_tensors(current, value)
    left = sorted(n for n, places in targets.items()
                  if any(id(getattr(m, s)[k]) not in done for m, s, k in places))
    if left:
        raise MaterialiseError(f"no value for {len(left)} tensor(s) of the model: "
                               f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}")


def _check(name: str, local: torch.Tensor, current: torch.Tensor) -> None:
    if tuple(local.shape) != tuple(current.shape):
        raise MaterialiseError(f"{name}: the source's tensor gives a slice of shape "
                               f"{tuple(local.shape)} where this rank keeps "
                               f"{tuple(current.shape)}")
