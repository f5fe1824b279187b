"""The model a verification trains and the planner judges (measure/verify.py, ranking.py,
`meshtrain plan --model`): meshtrain's GPT by its config's fields (a dict, as calibration's
and verify's own GPTs are given), or any model `meshtrain train --model` builds, by that
name (`TrainedModel`): a transformers preset or config.json, or a callable."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from meshtrain.measure import traced
from meshtrain.models import hf_presets, registry, structure
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner import model_spec
from meshtrain.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class TrainedModel:
    spec: str               # as `meshtrain train --model` takes it
    seq: int | None = None  # the sequence trained on (default: the model's context)


@functools.lru_cache(maxsize=8)
def model_of(name: str, seq: int | None) -> ModelSpec:
    """--model's ModelSpec: a planner preset or one of meshtrain's GPTs, else a model
    `meshtrain train --model` builds, built on the meta device (no memory, no
    initialisation) and read: a transformers model's shape from its config, a callable's
    from its modules, parameters counted either way; a transformers model's layers are
    also traced (measure/traced.py). Kept: verify prices every plan and role of one model,
    which would otherwise build it each time."""
    try:
        return model_spec.preset(name, seq=seq)
    except model_spec.ModelSpecError as not_preset:
        unknown = str(not_preset)
    try:
        kind = registry.kind_of(name)
    except registry.ModelSpecError:
        raise model_spec.ModelSpecError(
            f"{unknown}; or a model `meshtrain train --model` builds: a transformers preset "
            f"({', '.join(hf_presets.PRESETS)}), a transformers config (a .json file) or a "
            "callable (package.module:function)") from None
    with torch.device("meta"):
        built = registry.build_model(name, {}, seq)
    module, seq = built.module, seq or built.seq_len
    if kind == "callable":
        return model_spec.from_module(module, seq=seq, name=name)

    def count(*modules: nn.Module) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    layers = structure.units_of(module)
    pieces = [*layers, module.get_input_embeddings(), module.get_output_embeddings()]
    spec = replace(model_spec.from_transformers_config(
        module.config, seq, name, params=count(module), largest=max(map(count, pieces))),
        # ZeRO-3's root (all outside the decoder layers) and its last unit
        measured_gathered_once=count(module) - count(*layers) + count(layers[-1]))
    try:   # what its layers save and its elementwise work, beyond a GPT's counts
        found = traced.trace(lambda: registry.build_model(name, {}, seq).module, built.loss, seq)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        print(f"{name}: its forward does not run on fake tensors ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:120]}); its activations are priced from its "
              "shapes alone", file=sys.stderr)
        return spec
    return replace(spec, traced_layer_bytes=found.layer_bytes, traced_head_bytes=found.head_bytes,
                   traced_elementwise=found.elementwise_scale,
                   traced_selective_bytes=found.selective_bytes)


def spec_of(model: dict | TrainedModel) -> ModelSpec:
    """What the planner judges `model` as."""
    if isinstance(model, TrainedModel):
        return model_of(model.spec, model.seq)
    return model_spec.from_gpt_config(GPTConfig(**model), "gpt")


def build(model: dict | TrainedModel) -> tuple[nn.Module, Callable | None, int, int]:
    """(module, loss or None for the model's own `.loss`, token ids' range, sequence) of a
    freshly initialised `model`, from torch's global RNG; every model `meshtrain train`
    builds reads byte ids."""
    if isinstance(model, TrainedModel):
        built = registry.build_model(model.spec, {}, model.seq)
        return built.module, built.loss, registry.BYTE_VOCAB, built.seq_len
    config = GPTConfig(**model)
    return GPT(config), None, config.vocab_size, config.seq_len


def describe(model: dict | TrainedModel) -> str:
    if isinstance(model, TrainedModel):
        return model.spec + (f" at {model.seq} tokens" if model.seq else "")
    return "meshtrain's GPT " + ", ".join(f"{k} {v}" for k, v in model.items())
