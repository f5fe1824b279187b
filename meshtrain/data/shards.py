"""Token shards in llm.c's file format, written whole and read memory-mapped.

A shard is 256 little-endian int32 (the header: magic, version, token count, the rest 0) and
then the tokens: uint16 (magic 20240520, version 1: GPT-2's 50,257 words fit) or uint32
(magic 20240801, version 7: larger vocabularies). The files nanoGPT-style and llm.c scripts
write (`fineweb_train_000001.bin`, ...) are read as they are.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {(20240520, 1): np.dtype(np.uint16), (20240801, 7): np.dtype(np.uint32)}
"""(magic, version) -> token dtype, as llm.c's data_common.py writes them."""
_MAGIC_OF = {dtype: magic_version for magic_version, dtype in FORMATS.items()}


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file and the fix."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    if not 1 <= vocab_size <= 2**32:
        raise DataError(f"vocabulary of {vocab_size} words: token shards hold 1 to 2**32")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path, tokens: np.ndarray, dtype: np.dtype) -> None:
    """Write `tokens` as one shard at `path`, atomically (a kill leaves no partial shard)."""
    dtype = np.dtype(dtype)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"{path}: token ids {tokens.min()}..{tokens.max()} do not fit {dtype}")
    magic, version = _MAGIC_OF[dtype]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, tokens.size
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def token_layout(path) -> tuple[np.dtype, int, int]:
    """(token dtype, token count, byte offset of the first token) of a token file: an llm.c
    shard (read_header), or a 1-D uint16/uint32 `.npy` array (np.save's, as build-nanogpt's
    fineweb shards are written)."""
    if Path(path).suffix != ".npy":
        return (*read_header(path), HEADER_BYTES)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
            offset = f.tell()
    except ValueError as exc:
        raise DataError(f"{path}: not a .npy array ({exc}); give token shards") from None
    if len(shape) != 1 or dtype.str not in ("<u2", "<u4"):
        raise DataError(f"{path}: a .npy array of shape {shape} and dtype {dtype}; token files "
                        "hold one row of little-endian uint16 or uint32 ids")
    size = Path(path).stat().st_size
    if size != offset + shape[0] * dtype.itemsize:
        raise DataError(f"{path}: truncated: its header promises {shape[0]} {dtype.name} "
                        f"tokens but the file has {size} bytes; re-create it")
    return dtype, shape[0], offset


def read_header(path) -> tuple[np.dtype, int]:
    """(token dtype, token count) of the shard at `path`, refusing a file that is not one
    whole shard: another magic or version, or fewer or more bytes than its header says."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes, shorter than an llm.c token shard's "
                        f"{HEADER_BYTES}-byte header; the file is truncated or not a token "
                        "shard (prepare one with `meshtrain prepare`)")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    dtype = FORMATS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"magic {m} version {v} ({d.name})" for (m, v), d in FORMATS.items())
        raise DataError(f"{path}: header has magic {magic} version {version}, not an llm.c "
                        f"token shard ({known}); give shards written by `meshtrain prepare` "
                        "or llm.c's scripts (or nanoGPT's headerless uint16 file saved as .npy: "
                        "np.save('train.npy', np.memmap(PATH, np.uint16, 'r'))), or raw text "
                        "with --tokenizer")
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path}: {what}: the header promises {count} {dtype.name} tokens "
                        f"({expected} bytes) but the file has {size} bytes; re-create it "
                        "(`meshtrain prepare` resumes and rewrites a damaged shard)")
    return dtype, count


def open_shard(path) -> np.ndarray:
    """The shard's tokens, memory-mapped read-only: nothing is read until it is indexed."""
    dtype, count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES,
                     shape=(count,))


def read_windows(path, dtype: np.dtype, count: int, offset: int, starts: np.ndarray,
                 length: int) -> np.ndarray:
    """Rows of `length` tokens from each of `starts`, int64 (rows, length), through a map
    made for this read and closed after it: a map kept open would hold every page it ever
    touched (nanoGPT remaps per batch for this). The kernel is told to read only the
    windows' pages (MADV_RANDOM: no 128 KiB read-around per window) and to fetch them all at
    once (MADV_WILLNEED: the disk sees every window's request together); on a 4 GB shard out
    of the page cache, 16 windows read 25x faster than through a plain np.memmap.
    (dtype, count, offset) is the file's token_layout."""
    width = dtype.itemsize
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if hasattr(mmap, "MADV_RANDOM"):   # Linux and most Unixes; elsewhere plain faults
            mm.madvise(mmap.MADV_RANDOM)
            for first in (offset + starts * width).tolist():
                page = first - first % mmap.PAGESIZE
                mm.madvise(mmap.MADV_WILLNEED, page, first + length * width - page)
        tokens = np.frombuffer(mm, dtype=dtype.newbyteorder("<"), count=count, offset=offset)
        rows = tokens[starts[:, None] + np.arange(length)].astype(np.int64)   # (rows, length)
        del tokens   # the map closes only once no array views it
    finally:
        mm.close()
    return rows


def max_token(path, chunk_bytes: int = 2**26) -> int:
    """The largest id in one shard, read in chunks through a buffer (not mapped, so the
    reading process's memory stays at one chunk however large the file)."""
    dtype, _, offset = token_layout(path)
    best = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(chunk_bytes):
            best = max(best, int(np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).max()))
    return best
