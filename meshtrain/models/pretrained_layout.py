"""A model folder in the layout transformers converts as it loads, seen under the model's own
names: Mixtral's, Qwen-MoE's and OLMoE's experts saved one projection per expert
(`mlp.experts.0.gate_proj.weight` ...) where the modules hold them packed
(`mlp.experts.gate_up_proj`, experts x 2·ffn x hidden), or modules since renamed
(`block_sparse_moe.` -> `mlp.`). This is what `save_pretrained` writes and what the Hub's
checkpoints hold, so such a folder must load as `from_pretrained` loads it.

transformers' own conversion mapping for the model (`get_model_conversion_mapping`) says
which folder tensors make which of the model's and how (stack the experts, concatenate gate
and up); the packed shapes are found by running that conversion on meta tensors, so a folder
is checked from its headers alone, and a packed tensor is read (its experts' tensors) and
converted only when a rank asks for it.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from meshtrain.models.pretrained import SafetensorsFolder


def converted(folder: SafetensorsFolder, model: nn.Module) -> SafetensorsFolder:
    """`folder` as `model` names its tensors: itself where nothing needs converting."""
    plan = _plan(folder, model)
    return ConvertedFolder(folder, plan) if plan else folder


def _plan(folder: SafetensorsFolder, model: nn.Module) -> dict:
    """model name -> (the converter or None for a renaming, [(folder name, its pattern)])."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:   # no transformers (or one without conversions): names as they are
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    ours = {n for n, _ in [*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)]}
    plan: dict[str, tuple] = {}
    for name in sorted(folder.entries, key=dot_natural_key):   # experts in index order
        if name in ours:
            continue
        target, pattern = rename_source_key(name, renamings, converters)
        if target != name and target in ours:   # else left for check() to refuse by name
            converter = by_pattern.get(pattern) if pattern is not None else None
            plan.setdefault(target, (converter, []))[1].append((name, pattern))
    return plan


class ConvertedFolder(SafetensorsFolder):
    """A folder's tensors under the model's names: those already the model's as they are,
    the others converted (packed, renamed) from the folder's when read."""

    def __init__(self, source: SafetensorsFolder, plan: dict) -> None:
        self.folder, self.source, self.plan = source.folder, source, plan
        used = {name for _, names in plan.values() for name, _ in names}
        self.entries = {n: e for n, e in source.entries.items() if n not in used}
        for target, (_, names) in plan.items():
            file, _, dtype = source.entries[names[0][0]]
            fakes = [torch.empty(source.entries[n][1], device="meta") for n, _ in names]
            self.entries[target] = (file, tuple(self._convert(target, fakes).shape), dtype)

    def _convert(self, target: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        converter, names = self.plan[target]
        if converter is None:   # a renaming: the tensor as it is
            return tensors[0]
        converter = copy.deepcopy(converter)   # it collects the tensors it converts
        for (name, pattern), tensor in zip(names, tensors):
            converter.add_tensor(target, name, pattern, tensor)
        return converter.convert(target)[target]

    def tensors(self, device="cpu", wanted: set[str] | None = None):
        wanted = set(self.entries) if wanted is None else set(wanted)
        yield from self.source.tensors(device, wanted - set(self.plan))
        for target in sorted(wanted & set(self.plan)):
            names = [n for n, _ in self.plan[target][1]]
            read = dict(self.source.tensors(device, set(names)))
            yield target, self._convert(target, [read[n] for n in names])
