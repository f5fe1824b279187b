"""Byte-level text corpora, read into memory and split into train and validation bytes.

The default corpus is the running Python's own standard library source: present on every
machine that runs meshtrain, no download, and deterministic for one Python version. Nothing is
cached on disk; files are read until `max_bytes` is reached and no further.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

MIN_SPLIT_BYTES = 2 * 1024
"""Fewest bytes a train or val split may hold."""
_SNIFF_BYTES = 8 * 1024
"""A file with a NUL byte in its first this-many bytes is binary and skipped."""


@dataclass(frozen=True, eq=False)
class Corpus:
    train: torch.Tensor
    """Training bytes, uint8, 1-D: the first (1 - val_fraction) of the stream."""
    val: torch.Tensor
    """Validation bytes, uint8, 1-D: the rest of the stream."""
    source: str
    """Where the bytes came from, for logs, e.g. "Python 3.11 standard library (...)"."""
    num_files: int
    """Files that contributed bytes (the last one possibly cut at max_bytes)."""


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = 16 * 2**20,
                val_fraction: float = 0.1) -> Corpus:
    """Read a corpus: None -> this Python's stdlib `.py` files; a file -> its bytes; a folder
    -> its text files, recursively. Files are taken in sorted path order (component by
    component), joined with b"\\n", and cut at `max_bytes` (None: no limit)."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes={max_bytes!r}: must be a whole number >= 1, or None")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r}: must lie strictly between 0 and 1")

    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, lambda p: p.suffix == ".py",
                      skip_dir=lambda n: n in ("site-packages", "__pycache__"))
        label = f"Python {sys.version_info[0]}.{sys.version_info[1]} standard library"
        where = f"the standard library at {root}"
    else:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"corpus path {str(root)!r} does not exist; pass a text "
                                    f"file or a folder of text files, or None for the default")
        if root.is_file():
            _check_text_file(root)
            files = iter([root])
        else:
            files = _walk(root, _is_text, skip_dir=lambda n: n.startswith("."))
        label = str(root)
        where = repr(str(root))

    data, num_files = _read_until(files, max_bytes)
    if num_files == 0:
        raise ValueError(f"no text files found under {where}; point to a folder holding text "
                         f"files (binary files and hidden folders are skipped)")
    n_train = int(len(data) * (1.0 - val_fraction))
    if min(n_train, len(data) - n_train) < MIN_SPLIT_BYTES:
        raise ValueError(
            f"corpus from {where} is too small: {len(data)} bytes split {n_train} train / "
            f"{len(data) - n_train} val with val_fraction={val_fraction}, and each split needs "
            f">= {MIN_SPLIT_BYTES} bytes; add text, raise max_bytes, or adjust val_fraction")
    stream = torch.frombuffer(data, dtype=torch.uint8)
    source = f"{label} ({num_files} files, {_size(len(data))})"
    return Corpus(train=stream[:n_train], val=stream[n_train:], source=source,
                  num_files=num_files)


def _walk(root: Path, keep, skip_dir) -> Iterator[Path]:
    """Files under root that `keep` accepts, depth first, names sorted in each folder: the same
    order as sorting relative paths by their components. Lazy, so reading can stop early."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except PermissionError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if not skip_dir(entry.name):
                yield from _walk(Path(entry.path), keep, skip_dir)
        elif entry.is_file() and not entry.name.startswith(".") and keep(Path(entry.path)):
            yield Path(entry.path)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _check_text_file(path: Path) -> None:
    """A file named for byte-level training must be text: Parquet's compressed bytes or a
    binary would train, and JSON lines would train on their syntax."""
    if path.suffix in (".parquet", ".jsonl"):
        raise ValueError(f"{path}: {path.suffix[1:]} documents are read with a tokenizer: give "
                         "--tokenizer (or `meshtrain prepare` it); text read as bytes must be "
                         "a plain text file")
    if not _is_text(path):
        raise ValueError(f"{binary_file(path)}; give a text file or folder")


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return not looks_binary(f.read(_SNIFF_BYTES))


def looks_binary(data: bytes) -> bool:
    """A NUL byte in the first _SNIFF_BYTES of a file's `data`: binary, not text."""
    return b"\0" in data[:_SNIFF_BYTES]


def binary_file(path: Path) -> str:
    """What is said of a binary file named where text was expected."""
    return f"{path}: a binary file (a NUL byte in its first {_SNIFF_BYTES // 1024} KiB), not text"


def _read_until(files: Iterator[Path], max_bytes: int | None) -> tuple[bytearray, int]:
    """Concatenate files with b"\\n" between them, stopping once max_bytes are held."""
    data = bytearray()
    num_files = 0
    for path in files:
        if max_bytes is not None and len(data) >= max_bytes:
            break
        if num_files:
            data += b"\n"
        with open(path, "rb") as f:   # read no more than is still wanted: files may be huge
            data += f.read(-1 if max_bytes is None else max(max_bytes - len(data), 0))
        num_files += 1
    if max_bytes is not None:
        del data[max_bytes:]
    return data, num_files
