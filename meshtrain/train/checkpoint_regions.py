"""Reading only a rank's part of a checkpoint, with DCP's own planners.

[Note: a checkpoint in chunks]
DCP's file reader reads every stored chunk it touches whole (`torch.load` of the chunk), so
what a rank can skip is decided when the checkpoint is written. Each tensor is written as a
grid of chunks (DCP's multi-chunk tensors, as a sharded DTensor is written):
- cut where the saving plan's slot 1 cuts it (`LayerSharding.cuts`: each tp rank's slice,
  each fused part, each ep rank's experts), so a rank of the same plan reads its slice and
  nothing else;
- and dim 0 in row blocks of at most `CHUNK_BYTES` (one row where a row is larger), so a
  ZeRO shard, or another plan's slice, reads the blocks covering it: at most one block
  beyond it at each end of each tensor it cuts.
Loading (`RegionLoadPlanner`) asks DCP for the boxes of each tensor a rank's `Region`
(core/regions.py) names, through DCP's resharding read items
(`create_read_items_for_chunk_list`); the storage reader counts the bytes it reads. A rank
checksums only the files its reads touch (the sizes of all against the manifest).
A checkpoint written whole (one chunk a tensor, before this) still loads: it reads more.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                          create_read_items_for_chunk_list)
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed._shard._utils import narrow_tensor_by_index   # as DCP imports it

from meshtrain.core.regions import Box, Region
from meshtrain.train.checkpoint_reader import load_plain_value

CHUNK_BYTES = 1 << 20   # a row block: a flat range reads at most one more at each end
EntryPath = tuple   # a state-dict entry: ("model", key) or ("optim", "state", name, k)
CutsOf = Callable[[EntryPath, tuple[int, ...]], list[list[int]]]
RegionOf = Callable[[EntryPath, tuple[int, ...]], Region | None]
Placed = dict[EntryPath, tuple[tuple[int, ...], tuple[Box, ...]]]   # (whole shape, boxes)


def chunk_grid(shape: tuple[int, ...], cuts: list[list[int]], itemsize: int,
               chunk_bytes: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each chunk a tensor of `shape` is written as: cut at `cuts` (per
    dim) and dim 0 in row blocks of at most `chunk_bytes`."""
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), tuple(shape))]
    row_bytes = math.prod(shape[1:]) * itemsize
    block = max(1, chunk_bytes // max(1, row_bytes))
    edges = []
    for d, size in enumerate(shape):
        points = {c for c in (cuts[d] if d < len(cuts) else []) if 0 < c < size}
        if d == 0:
            points |= set(range(block, size, block))
        bounds = [0, *sorted(points), size]
        edges.append(list(zip(bounds[:-1], bounds[1:])))
    return [(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))
            for spans in itertools.product(*edges)]


class ChunkedSavePlanner(DefaultSavePlanner):
    """DCP's save planner with each tensor written as `chunk_grid`'s chunks. A tensor
    `placed` names (entry path -> (whole shape, boxes)) is a part of a whole tensor: each
    box (`core/regions.Box`: its offsets and sizes in the whole, `local` where it starts
    in the part) is written as the chunks of the whole's grid, cut at the box's edges,
    that fall in it, at their offsets in the whole."""

    def __init__(self, cuts_of: CutsOf, chunk_bytes: int,
                 placed: Placed | None = None) -> None:
        super().__init__()
        self.cuts_of, self.chunk_bytes, self.placed = cuts_of, chunk_bytes, placed or {}
        self.in_part: dict[tuple, tuple[int, ...]] = {}   # (fqn, offsets) -> offsets in part

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.type != WriteItemType.TENSOR:
                items.append(item)
                continue
            data, fqn = item.tensor_data, item.index.fqn
            entry = self.mappings.get(fqn, (fqn,))
            shape, boxes = self.placed.get(entry, (tuple(data.size), None))
            for box in boxes or [None]:
                for offsets, sizes in self._chunks(entry, shape, data, box):
                    self.in_part[fqn, offsets] = offsets if box is None else tuple(
                        at + o - b for at, o, b in zip(box.local, offsets, box.offsets))
                    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk, data.properties, torch.Size(shape))))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _chunks(self, entry, shape, data, box):
        """The grid's chunks of the whole tensor in `box` (None: all of them)."""
        cuts = [list(c) for c in self.cuts_of(entry, shape)] or [[] for _ in shape]
        cuts += [[] for _ in range(len(shape) - len(cuts))]
        if box is not None:
            cuts = [[*c, o, o + s] for c, o, s in zip(cuts, box.offsets, box.sizes)]
        return [(offsets, sizes) for offsets, sizes in chunk_grid(
                    shape, cuts, data.properties.dtype.itemsize, self.chunk_bytes)
                if box is None or all(o <= a < o + s for a, o, s in
                                      zip(offsets, box.offsets, box.sizes))]

    def resolve_data(self, write_item: WriteItem):
        if write_item.type != WriteItemType.SHARD:
            return super().resolve_data(write_item)
        fqn, chunk = write_item.index.fqn, write_item.tensor_data.chunk
        return narrow_tensor_by_index(self.state_dict[fqn],
                                      self.in_part[fqn, tuple(chunk.offsets)], chunk.sizes)


class RegionLoadPlanner(DefaultLoadPlanner):
    """Reads, of each tensor, the boxes `region_of(path, shape)` names (None: nothing of
    it), and every non-tensor value (plain data, read weights-only). `state()` gives the
    nested state dict of what was read, each tensor as its region assembles it."""

    def __init__(self, path, region_of: RegionOf,
                 verify: Callable[[set[str]], None] = lambda files: None) -> None:
        """`verify(files)`: checks the files the plan reads, before any is read."""
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path, self.region_of, self.verify = path, region_of, verify

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata, self.is_coordinator = metadata, is_coordinator
        self.state_dict, self.mappings = {}, dict(metadata.planner_data or {})
        self.reads: dict[str, tuple[Region, list[torch.Tensor]]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                self.state_dict[fqn] = None   # a plain value: always read (it is small)
                continue
            region = self.region_of(self.mappings.get(fqn, (fqn,)), tuple(md.size))
            if region is not None:
                self.reads[fqn] = (region, [torch.empty(box.sizes, dtype=md.properties.dtype,
                                                        device="cpu")
                                            for box in region.reads()])

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn in self.state_dict:
            items += _create_read_items(fqn, self.metadata.state_dict_metadata[fqn], None)
        for fqn, (region, _) in self.reads.items():
            chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                      for b in region.reads()]
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], chunks)
        self.verify({self.metadata.storage_data[item.storage_index].relative_path
                     for item in items})
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = load_plain_value(value, fqn, self.path)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buffer = self.reads[read_item.dest_index.fqn][1][read_item.dest_index.index]
        return narrow_tensor_by_index(buffer, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass   # read in place

    def state(self) -> dict:
        flat = dict(self.state_dict)
        for fqn, (region, parts) in self.reads.items():
            flat[fqn] = region.assemble(parts, parts[0].dtype if parts else
                                        self.metadata.state_dict_metadata[fqn].properties.dtype)
        return unflatten_state_dict(flat, {k: v for k, v in self.mappings.items() if k in flat})
