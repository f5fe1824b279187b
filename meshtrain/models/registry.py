"""Which model a run trains, from the one string `meshtrain train --model` takes:

    tiny | small | gpt2-124m | ...      meshtrain's GPT preset (with --layers, --d-model, ... overrides)
    my_pkg.my_module:build               a callable returning an nn.Module
    path/to/config.json                  a transformers causal-LM configuration, random weights
    path/to/folder                       ... the folder's config.json (save_pretrained's folder)
                                          (needs the optional extra: pip install -e ".[hf]")
    llama-tiny | qwen2-tiny | ...        a tiny transformers causal LM built offline from
                                          transformers' config classes (models/hf_presets.py)

Every model reads token ids (B, T) and returns logits (B, T, V) over the byte vocabulary, or
(transformers) an output whose `.logits` are those; transformers models are trained as
built, under their own parameter names. The loss is the model's own `.loss(logits, targets)`
when it has one, else the mean cross-entropy over every token.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.models.gpt import GPT, PRESETS, gpt_config

BYTE_VOCAB = 256


def logits_of(output) -> torch.Tensor:
    """A model's logits: the output itself, or its `.logits` (transformers' outputs)."""
    return output.logits if hasattr(output, "logits") else output


def token_cross_entropy(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (..., V) (or an output with `.logits`),
    targets (...) int64. Passed as the Trainer's `loss_fn` with a tensor-parallel plan whose
    output layer is "vocab", it is computed vocab-parallel, without gathering the logits."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class BuiltModel:
    module: nn.Module
    loss: Callable
    seq_len: int
    kind: str          # "gpt" | "callable" | "transformers"


class ModelSpecError(ValueError):
    """A --model that cannot be built: the message names it and the fix."""


def kind_of(spec: str) -> str:
    from meshtrain.models.hf_presets import PRESETS as HF_PRESETS

    if spec in PRESETS:
        return "gpt"
    if spec in HF_PRESETS:
        return "hf-preset"
    if spec.endswith(".json") or (Path(spec) / "config.json").is_file():
        return "transformers"
    if ":" in spec:
        return "callable"
    raise ModelSpecError(f"--model {spec!r} is unknown: neither a GPT preset ({', '.join(PRESETS)}), "
                         f"a transformers preset ({', '.join(HF_PRESETS)}), a callable "
                         "(package.module:function) nor a transformers config (a .json file, "
                         "or a folder holding config.json)")


def check_model_spec(spec: str, overrides: dict) -> None:
    """Refuse a --model that cannot be built, without building it (the command's check before
    it starts any rank)."""
    kind = kind_of(spec)
    if kind == "gpt":
        config = gpt_config(spec, **overrides)
        if "top_k" in overrides and not config.experts:
            raise ModelSpecError(f"--top-k {overrides['top_k']} routes each token among "
                                 f"experts, and {spec!r} has none (dense MLPs); add --experts "
                                 "N, or use --model gpt-moe-tiny")
    elif {"experts", "top_k"} & set(overrides) and kind != "callable":
        from meshtrain.models.moe import router_of_config

        router = router_of_config(transformers_config(spec))
        has = (f"{router.experts} experts per layer, top-{router.top_k}" if router else
               "no experts (dense MLPs)")
        raise ModelSpecError(f"--experts/--top-k shape meshtrain's GPT presets only; {spec!r} "
                             f"is a transformers model whose config says {has}: drop them, or "
                             "give a config.json with the experts you want (num_local_experts "
                             "or num_experts, num_experts_per_tok)")
    elif overrides:
        raise ModelSpecError(f"--layers/--d-model/--heads/--experts/--top-k shape meshtrain's "
                             f"GPT presets only; {spec!r} builds its own model: drop them")
    elif kind == "callable":
        _resolve(spec)
    else:
        transformers_config(spec)


def transformers_config(spec: str):
    """The transformers config `spec` names (a preset or a config.json), checked: an
    architecture transformers knows, with a causal LM, and a vocabulary holding the bytes."""
    from meshtrain.models import hf_presets

    try:
        import transformers
    except ImportError:
        raise ModelSpecError("--model given as a transformers config needs transformers: "
                             'pip install -e ".[hf]"') from None
    if spec in hf_presets.PRESETS:
        return hf_presets.config_of(spec)
    if Path(spec).is_dir():   # a folder save_pretrained wrote
        spec = str(Path(spec) / "config.json")
    if not Path(spec).is_file():
        raise ModelSpecError(f"--model {spec!r}: no such configuration file")
    try:
        config = transformers.AutoConfig.from_pretrained(str(Path(spec)))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelSpecError(f"--model {spec}: transformers cannot read this configuration "
                             f"({str(exc).splitlines()[0]}); give a config.json of an "
                             "architecture transformers knows (its model_type)") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelSpecError(f"--model {spec}: model_type {config.model_type!r} has no causal "
                             "LM in transformers; give a decoder's config (llama, qwen2, gpt2...)")
    if getattr(config, "vocab_size", 0) < BYTE_VOCAB:
        raise ModelSpecError(f"{spec}: vocab_size={getattr(config, 'vocab_size', None)} is "
                             f"smaller than the byte vocabulary ({BYTE_VOCAB})")
    return config


def build_model(spec: str, overrides: dict, seq_len: int | None = None,
                on_meta: bool = False) -> BuiltModel:
    """The model `spec` names (see the module docstring), freshly initialised from torch's
    global RNG. `on_meta`: built on the meta device with its initialisation recorded
    (models/deferred.py), for the Trainer to make real only where each rank keeps it; a
    model whose construction reads values is built eagerly instead, and said so."""
    kind = kind_of(spec)
    if kind == "gpt":
        config = gpt_config(spec, **overrides)
        model = _built(lambda: GPT(config), on_meta, spec)
        return BuiltModel(model, model.loss, config.seq_len, kind)
    check_model_spec(spec, overrides)
    make = _from_callable if kind == "callable" else _from_transformers
    module = _built(lambda: make(spec), on_meta, spec)
    seq_len = seq_len or _context_of(module) or DEFAULT_SEQ
    check_positions(module, seq_len)
    if kind != "callable":
        return BuiltModel(module, token_cross_entropy, seq_len, "transformers")
    loss = getattr(module, "loss", None) or token_cross_entropy
    return BuiltModel(module, loss, seq_len, kind)


def check_positions(module: nn.Module, seq_len: int) -> None:
    """Refuse a sequence longer than a learned position table (GPT-2's `wpe`: a row per
    position of its context), which would index past it inside the forward; rotary
    positions have no table and are not limited here."""
    context = _context_of(module)
    if context is None or seq_len <= context:
        return
    inputs = getattr(module, "get_input_embeddings", lambda: None)()
    for name, m in module.named_modules():
        if isinstance(m, nn.Embedding) and m is not inputs and m.num_embeddings == context:
            raise ModelSpecError(f"--seq {seq_len} is longer than the {context} positions "
                                 f"{type(module).__name__} learned ({name}: one row per "
                                 f"position); use --seq {context} or less")


def _resolve(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:   # as `python -m` would: the user's own package
        sys.path.insert(0, os.getcwd())
    try:
        fn = importlib.import_module(module_name)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as exc:
        raise ModelSpecError(f"--model {spec!r}: cannot import it ({exc}); give "
                             "package.module:function, importable from this folder") from None
    if not callable(fn):
        raise ModelSpecError(f"--model {spec!r} is not callable")
    return fn


def _built(build: Callable[[], nn.Module], on_meta: bool, spec: str) -> nn.Module:
    if not on_meta:
        return build()
    from meshtrain.models.deferred import DeferredInitError, build_on_meta

    try:
        return build_on_meta(build)
    except DeferredInitError as exc:
        print(f"meshtrain: --model {spec} cannot be built on the meta device ({exc}); "
              "every rank builds it whole first", file=sys.stderr)
        return build()


def _from_callable(spec: str) -> nn.Module:
    model = _resolve(spec)()
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model {spec!r} returned a {type(model).__name__}, not an "
                             "nn.Module")
    return model


def _from_transformers(spec: str) -> nn.Module:
    """The causal LM as transformers builds it from its config: no wrapper (the Trainer
    reads its logits, layers and tp plan itself: models/hf.py). In torch's default dtype
    (fp32) whatever dtype the config records (a bf16 checkpoint's "dtype": "bfloat16"): the
    Plan's precision decides the compute, and the weights stay fp32 masters."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(transformers_config(spec),
                                            dtype=torch.get_default_dtype())


def _context_of(module: nn.Module) -> int | None:
    return context_of(getattr(getattr(module, "model", module), "config", None))


DEFAULT_SEQ, LONGEST_DEFAULT_SEQ = 128, 2048


def default_seq(context: int | None) -> int:
    """The sequence `meshtrain train` trains a model on without --seq: its context, at most
    2048 tokens (a long-context model's 32k or 128k, times the batch, is no first run), 128
    where its config states none. (The planner prices the whole context.)"""
    return min(context, LONGEST_DEFAULT_SEQ) if context else DEFAULT_SEQ


def context_of(config) -> int | None:
    """A transformers config's context length (None: it states none)."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
