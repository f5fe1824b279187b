"""Pretrained weights read tensor by tensor from a transformers model folder, so that no rank
ever holds the whole model: `config.json` beside one `model.safetensors`, or several shards
named by `model.safetensors.index.json` (what `save_pretrained` writes, and `meshtrain
export`).

    model = from_pretrained("my-llama/")   # on the meta device, the folder its source
    trainer = Trainer(model, plan, opt)    # each rank reads only the tensors it keeps

Everything that can be wrong with a folder is found before any tensor is read (the headers
say every tensor's name, shape and dtype): a missing or truncated file, an index naming
absent files, a tensor of another shape or kind than the model's, a tensor the model lacks
or lacks a value for. Tensors the folder does not hold (non-persistent buffers such as
RoPE's inv_freq) come from the model's recorded build (models/deferred.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class PretrainedError(ValueError):
    """A folder that cannot give this model its weights: the message names the file and
    the tensor."""


class SafetensorsFolder:
    """A model folder's tensors: name -> (file, shape, dtype), read from the headers."""

    def __init__(self, folder) -> None:
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        _check_folder(self.folder)
        index = self.folder / INDEX
        if index.is_file():
            weight_map = _read_index(index)
        elif (self.folder / SINGLE).is_file():
            weight_map = None
        else:
            raise PretrainedError(f"{self.folder} holds no {SINGLE} nor {INDEX}: give a folder "
                                  "that save_pretrained(...) wrote (safetensors weights)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise PretrainedError(f"{index} names {name}, which is not in {self.folder}")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if weight_map is None or weight_map.get(key) == name:
                            piece = f.get_slice(key)
                            self.entries[key] = (name, tuple(piece.get_shape()), piece.get_dtype())
            except SafetensorError as exc:
                raise PretrainedError(f"{path} cannot be read ({exc}): truncated or not a "
                                      "safetensors file; write it again") from None
        if weight_map:
            absent = sorted(k for k in weight_map if k not in self.entries)
            if absent:
                raise PretrainedError(f"{index} lists {absent[:3]} in files that do not hold "
                                      "them: the shards and the index disagree")

    def check(self, model: nn.Module, ignored: set[str] = frozenset()) -> None:
        """Refuse, naming the file and tensor, what does not fit `model` (on any device)."""
        ours = {n: t for n, t in [*model.named_parameters(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False)]}
        persistent = set(model.state_dict(keep_vars=True))
        for name, (file, shape, dtype) in self.entries.items():
            if name not in ours:
                if name in ignored:
                    continue
                raise PretrainedError(f"{self.folder / file}: {name} is not a tensor of "
                                      f"{type(model).__name__}: the folder is another model's")
            want = ours[name]
            if shape != tuple(want.shape):
                raise PretrainedError(f"{self.folder / file}: {name} has shape {list(shape)}, the "
                                      f"model's is {list(want.shape)}: the folder's config and "
                                      "weights are another model's")
            if _is_float(dtype) != want.is_floating_point():
                raise PretrainedError(f"{self.folder / file}: {name} is {dtype}, the model's "
                                      f"is {want.dtype}")
        first = {}
        for name in persistent:   # tied tensors: one name in the folder is enough
            first.setdefault(id(ours[name]), []).append(name)
        missing = sorted(names[0] for names in first.values()
                         if not any(n in self.entries for n in names))
        if missing:
            raise PretrainedError(f"{self.folder} holds no value for {len(missing)} tensor(s) of "
                                  f"the model: {', '.join(missing[:5])}")

    def tensors(self, device="cpu", wanted: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) for each tensor `wanted` (default all), one at a time."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name, (file, _, _) in self.entries.items():
            if wanted is None or name in wanted:
                by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(str(self.folder / file), framework="pt", device=str(device)) as f:
                for name in names:
                    yield name, f.get_tensor(name)


class PretrainedSource:
    """A folder's tensors first, then the recorded build's for what the folder lacks. A
    tensor known by several names (tied weights) is read under the name the folder has and
    given under every name asked for: a pipeline's last stage asks for its output layer,
    which the folder holds as the embedding."""

    def __init__(self, folder: SafetensorsFolder, recording) -> None:
        self.folder, self.recording = folder, recording
        by_storage: dict[int, list[str]] = {}
        for name, ref in recording.names.items():
            by_storage.setdefault(ref.storage, []).append(name)
        self.names_of: dict[str, list[str]] = {}   # folder name -> every name of its tensor
        for names in by_storage.values():
            held = next((n for n in names if n in folder.entries), None)
            if held is not None:
                self.names_of[held] = names

    def tensors(self, device="cpu", wanted: set[str] | None = None):
        wanted = set(self.recording.names) if wanted is None else set(wanted)
        reading = {held for held, names in self.names_of.items() if wanted & set(names)}
        given = set()
        for held, value in self.folder.tensors(device, reading):
            for name in self.names_of[held]:
                if name in wanted:
                    given.add(name)
                    yield name, value
        if wanted - given:
            yield from self.recording.tensors(device, wanted=wanted - given)


def from_pretrained(folder) -> nn.Module:
    """The transformers causal LM a model folder holds, on the meta device, its weights read
    from the folder only where a rank keeps them (pass it to Trainer). Every problem with the
    folder is refused here, naming the file and the tensor, before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshtrain.models.deferred import build_on_meta

    folder = Path(folder)
    weights = SafetensorsFolder(folder)
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (ValueError, OSError) as exc:
        raise PretrainedError(f"{folder / 'config.json'} cannot be read by transformers "
                              f"({str(exc).splitlines()[0]})") from None
    return attach(build_on_meta(lambda: AutoModelForCausalLM.from_config(
        config, dtype=torch.get_default_dtype())), weights)   # as registry builds it


def attach(model: nn.Module, weights: SafetensorsFolder) -> nn.Module:
    """`model` (built on the meta device, its build recorded) to take its values from
    `weights` where the folder has them; checked against it first."""
    from meshtrain.models.deferred import attach_source, recording_of
    from meshtrain.models.pretrained_layout import converted

    recording = recording_of(model)
    if recording is None:
        raise PretrainedError("the model must be built with build_on_meta(...) to load a "
                              "folder into it slice by slice")
    weights = converted(weights, model)   # per-expert or renamed tensors, as transformers loads
    weights.check(model, ignored={n for n in weights.entries if n.endswith(".inv_freq")})
    return attach_source(model, PretrainedSource(weights, recording))


def _check_folder(folder: Path) -> None:
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise PretrainedError(f"{folder} has no config.json: give a folder save_pretrained "
                                  "wrote (config.json and safetensors weights)")
        return
    if folder.is_file():
        raise PretrainedError(f"{folder} is a file; give the folder holding it and its weights"
                              f": {folder.parent}")
    looks_like_hub = str(folder).count("/") == 1 and not str(folder).startswith((".", "/"))
    if looks_like_hub:
        raise PretrainedError(f"{folder} is no folder here; a Hugging Face Hub name needs the "
                              "network, which meshtrain does not use: download it first "
                              f"(huggingface-cli download {folder} --local-dir DIR) and pass DIR")
    raise PretrainedError(f"{folder}: no such folder")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise PretrainedError(f"{index} is not a safetensors index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise PretrainedError(f"{index}: its weight_map is empty or not a mapping")
    return weight_map


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("F", "BF")) or dtype.startswith("E")   # F32, BF16, F8_E4M3...
