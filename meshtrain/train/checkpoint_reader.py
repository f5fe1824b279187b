"""Reading a checkpoint never runs code from it.

torch.distributed.checkpoint reads two things with pickle: its `.metadata` file (a plain
`pickle.load` in `FileSystemReader.read_metadata`) and every non-tensor value of the state
dict, such as the optimizer's hyper-parameters (`torch.load(..., weights_only=False)` in
`DefaultLoadPlanner.load_bytes`). A checkpoint folder received from elsewhere can put any
callable behind either (`os.system`, `eval`, ...), and unpickling would call it. These two
subclasses close both doors and leave the rest of DCP's reading untouched:

- `SafeFileSystemReader` reads `.metadata` with `RestrictedUnpickler`, which admits only
  the classes DCP's metadata is made of (its metadata dataclasses, tensor properties, torch
  dtypes, sizes and layouts, paths) and refuses any other global by name;
- `SafeLoadPlanner` reads non-tensor values with `torch.load(weights_only=True)`, torch's
  own restricted unpickler (plain containers, numbers, strings, tensors);
- tensor payloads were already read with `weights_only=True` by DCP itself.

A refusal is an `UnsafeCheckpoint` naming the file and the global it would have called.
"""
from __future__ import annotations

import io
import math
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from meshtrain.train.errors import CheckpointError
# DCP's planner that builds the state dict from the checkpoint's own metadata (what
# torch.distributed.checkpoint.format_utils uses to read a checkpoint whole)
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a genuine `.metadata` holds (torch 2.13: found by recording find_class while
# loading checkpoints of every plan), and nothing else.
ALLOWED_GLOBALS = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # str -> torch.layout, a table look-up
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file whose pickle would call or import something no checkpoint needs."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is even imported."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{self.source} refers to {module}.{name}, which no checkpoint contains; loading "
            "it would run code from the file. Refused: do not use this checkpoint (it was "
            "altered or made by something other than meshtrain)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by `RestrictedUnpickler`. `tensor_bytes`
    counts the tensor payload its reads take from the files: each stored chunk a read
    touches, whole (DCP reads it whole); plain values (a few hundred bytes) are left out."""

    tensor_bytes = 0

    def set_up_storage_reader(self, metadata: Metadata, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            entry, index = self._tensors[item.storage_index.fqn], item.storage_index
            if not isinstance(entry, BytesStorageMetadata):
                chunk = (entry.chunks[index.index] if index.index is not None else
                         next(c for c in entry.chunks if c.offsets == index.offset))
                self.tensor_bytes += math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = RestrictedUnpickler(stream, str(path)).load()
            except UnsafeCheckpoint:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path} is not a checkpoint's metadata ({type(exc).__name__}: "
                                      f"{exc}); use an earlier checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint's "
                                  "metadata; use an earlier checkpoint")
        if getattr(metadata, "storage_meta", None) is None:   # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Reads a checkpoint whole (the state dict is rebuilt from its metadata: every tensor
    at its saved shape), with non-tensor values read by torch's weights-only unpickler
    instead of DCP's full `torch.load`."""

    def __init__(self, path) -> None:
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = load_plain_value(value, read_item.dest_index.fqn, self.path)
        # `loaded` is plain data now; DCP's own method stores it where it belongs, from a
        # copy re-serialised here (its full torch.load then reads only what we wrote)
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def load_plain_value(stream, fqn: str, path):
    """A non-tensor value of the state dict, read by torch's weights-only unpickler."""
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(
            f"{path}: the value of {fqn!r} is not plain data ({_why_refused(exc)}); loading "
            "it would run code from the file. Refused: do not use this checkpoint (it was "
            "altered or made by something other than meshtrain)") from None


def check_checkpoint_files(path) -> Metadata:
    """Read, in this process, everything in a checkpoint that is unpickled: the metadata and
    every non-tensor value (a few hundred bytes each). Raises UnsafeCheckpoint or
    CheckpointError; tensors are left to the load itself (they are read weights-only)."""
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        where = metadata.storage_data[MetadataIndex(fqn)]
        try:
            with open(Path(path) / where.relative_path, "rb") as f:
                f.seek(where.offset)
                raw = io.BytesIO(f.read(where.length))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {where.relative_path} ({exc}); the "
                                  "checkpoint is incomplete: use an earlier one") from None
        load_plain_value(raw, fqn, path)
    return metadata


def _why_refused(exc: Exception) -> str:
    """The line of torch's weights-only error that names what it refused."""
    for line in str(exc).splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip().rstrip(".")[:200]
    return "refused by torch's weights-only unpickler"
