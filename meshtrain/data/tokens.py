"""Token datasets read without holding them: llm.c-format shards (shards.py), memory-mapped,
split into train and validation, read window by window.

A dataset is a folder `meshtrain prepare` wrote (its shards and `index.json`), one or more
`.bin` shards (a file, a folder of them, or a glob such as `data/fineweb_*.bin`), or `.npy`
arrays of uint16/uint32 ids (build-nanogpt's `edufineweb_train_000001.npy`). Validation:
the shards whose names say `val` (llm.c's `fineweb_val_000000.bin`) where some do, else the
last tenth of the tokens, at most VAL_TOKENS_MAX of them.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshtrain.data.shards import DataError, max_token, read_windows, token_layout

INDEX = "index.json"
SUFFIXES = (".bin", ".npy")   # llm.c shards; np.save's arrays (build-nanogpt's shards)
VAL_FRACTION = 0.1
VAL_TOKENS_MAX = 2**20
"""The held-out tail of a dataset without val shards: enough for evaluation's windows, and
no more of a large dataset than that."""
_VAL_NAME = re.compile(r"(^|[_.-])val([_.-]|$)")


@dataclass(frozen=True)
class Piece:
    """Tokens [lo, hi) of the shard at `path`."""
    path: str
    lo: int
    hi: int


class TokenStream:
    """One split's tokens: pieces of shards, in order. A window never crosses two pieces.
    Reads only the windows asked for, through maps made for one read and closed after it
    (shards.read_windows), so a rank's memory grows neither with the dataset nor with the
    steps."""

    def __init__(self, pieces, vocab_size: int | None = None) -> None:
        self.pieces = tuple(p for p in pieces if p.hi > p.lo)
        self.vocab_size = vocab_size
        self._headers: dict[str, tuple] = {}   # path -> its token_layout, read once

    def numel(self) -> int:
        return sum(p.hi - p.lo for p in self.pieces)

    def num_windows(self, seq_len: int) -> int:
        """Starts of windows of seq_len+1 tokens inside one piece."""
        return sum(max(0, p.hi - p.lo - seq_len) for p in self.pieces)

    def read(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Windows number `offsets` (in [0, num_windows)), int64 (rows, seq_len+1)."""
        counts = np.array([max(0, p.hi - p.lo - seq_len) for p in self.pieces], dtype=np.int64)
        ends = np.cumsum(counts)
        offsets = offsets.numpy()
        which = np.searchsorted(ends, offsets, side="right")    # (rows,) piece of each window
        out = np.empty((len(offsets), seq_len + 1), dtype=np.int64)
        for i in np.unique(which):
            rows = np.nonzero(which == i)[0]
            piece = self.pieces[i]
            starts = offsets[rows] - (ends[i] - counts[i]) + piece.lo
            if piece.path not in self._headers:
                self._headers[piece.path] = token_layout(piece.path)
            out[rows] = read_windows(piece.path, *self._headers[piece.path], starts,
                                     seq_len + 1)   # (rows_i, T+1)
            self._check_ids(out[rows], piece, starts)
        return torch.from_numpy(out)

    def _check_ids(self, windows: np.ndarray, piece: Piece, starts: np.ndarray) -> None:
        if self.vocab_size is not None and windows.size and windows.max() >= self.vocab_size:
            row = int(np.argmax(windows.max(axis=1)))
            at = int(starts[row]) + int(np.argmax(windows[row]))
            raise DataError(f"{piece.path}: token {at} is id {int(windows.max())}, at or above "
                            f"the vocabulary of {self.vocab_size}; the shard was made with "
                            "another tokenizer, or the model's vocabulary is too small")

    def __repr__(self) -> str:
        return f"TokenStream({self.numel()} tokens in {len(self.pieces)} piece(s))"


@dataclass(frozen=True, eq=False)
class TokenData:
    train: TokenStream
    val: TokenStream
    source: str
    """What was read and how it was split, for logs."""
    files: tuple[str, ...]
    index: dict | None
    """The dataset's index.json (prepare's), None for bare shards."""
    fingerprint: str
    """Names and token counts of every file: a checkpoint's data is checked against it."""

    @property
    def vocab_size(self) -> int | None:
        return (self.index or {}).get("vocab_size")

    @property
    def max_token(self) -> int:
        """The largest id in the dataset: the index's, else scanned (once, chunk by chunk)."""
        if self.index and "max_token" in self.index:
            return int(self.index["max_token"])
        return max(cached_max_token(f) for f in self.files)


def is_token_data(spec: str) -> bool:
    """Whether `--data spec` names token shards (else it is text)."""
    path = Path(spec)
    if "*" in spec or path.suffix in SUFFIXES:
        return True
    return path.is_dir() and ((path / INDEX).exists() or any(
        f.suffix in SUFFIXES for f in path.iterdir()))


def open_tokens(spec: str, vocab_size: int | None = None) -> TokenData:
    """The dataset `spec` names (module docstring), split; ids at or above `vocab_size` (the
    model's) are refused when read."""
    files, index = _files_of(spec)
    counts = [token_layout(f)[1] for f in files]   # every header checked, before any rank reads
    if sum(counts) == 0:
        raise DataError(f"--data {spec}: the dataset holds no tokens ({len(files)} empty "
                        "shard(s)); prepare it from text with `meshtrain prepare`")
    limit = vocab_size if vocab_size is not None else (index or {}).get("vocab_size")
    train, val, how = _split(files, counts)
    fingerprint = hashlib.sha256(json.dumps(
        [[Path(f).name, c] for f, c in zip(files, counts)]).encode()).hexdigest()[:16]
    made = ((index or {}).get("settings") or {}).get("inputs") or []   # prepare's text
    origin = f"made from {made[0]}{f' and {len(made) - 1} more' if len(made) > 1 else ''}; " \
        if made else ""
    source = f"{spec} ({origin}{len(files)} shard(s), {sum(counts):,} tokens; validation: {how})"
    return TokenData(TokenStream(train, limit), TokenStream(val, limit), source,
                     tuple(files), index, fingerprint)


def _files_of(spec: str) -> tuple[list[str], dict | None]:
    path = Path(spec)
    if "*" in spec:
        files = sorted(path.parent.glob(path.name))
        if not files:
            raise DataError(f"--data {spec}: no file matches; give shards that exist")
        return [str(f) for f in files], None
    if not path.exists():
        raise DataError(f"--data {spec}: no such file or folder")
    if path.is_file():
        return [str(path)], None
    index_path = path / INDEX
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            names = [s["file"] for s in index["shards"]]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{index_path}: not a dataset index ({exc}); re-run "
                            "`meshtrain prepare` into this folder") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise DataError(f"{index_path} lists {missing[0]}, which is missing; re-run "
                            "`meshtrain prepare` into this folder (it resumes)")
        return [str(path / n) for n in names], index
    files = sorted(str(f) for f in path.iterdir() if f.suffix in SUFFIXES)
    if not files:
        raise DataError(f"--data {spec}: the folder holds no .bin or .npy token shards and no "
                        f"{INDEX}; prepare text with `meshtrain prepare`")
    return files, None


def _split(files: list[str], counts: list[int]) -> tuple[list[Piece], list[Piece], str]:
    """(train pieces, val pieces, the rule used, in words)."""
    is_val = [bool(_VAL_NAME.search(Path(f).stem)) for f in files]
    if any(is_val) and not all(is_val):
        val = [Piece(f, 0, n) for f, n, v in zip(files, counts, is_val) if v]
        train = [Piece(f, 0, n) for f, n, v in zip(files, counts, is_val) if not v]
        return train, val, f"the shards named *val* ({len(val)})"
    total = sum(counts)
    held = min(int(total * VAL_FRACTION), VAL_TOKENS_MAX)
    cut = total - held   # tokens before `cut` train, the rest validate
    train, val, seen = [], [], 0
    for f, n in zip(files, counts):
        train.append(Piece(f, 0, min(n, max(0, cut - seen))))
        val.append(Piece(f, min(n, max(0, cut - seen)), n))
        seen += n
    return train, val, f"the last {held:,} tokens (a tenth, at most 2**20)"


def cache_dir() -> Path:
    """Where meshtrain keeps what it derives from datasets: `$XDG_CACHE_HOME/meshtrain/tokens`
    (default ~/.cache/meshtrain/tokens)."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "meshtrain" / \
        "tokens"


def cached_max_token(path) -> int:
    """A bare shard's largest id, scanned once per (path, size, time) and kept in
    `cache_dir()/max_token.json`: a multi-GB shard is read once, not per run."""
    import os
    import sys

    stat = os.stat(path)
    key = f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = cache_dir() / "max_token.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key not in known:
        if stat.st_size > 2**28:
            print(f"meshtrain: reading {path} once for its largest token id", file=sys.stderr)
        known[key] = max_token(path)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    return known[key]
