"""Text into token shards, once: the job behind `meshtrain prepare`.

Documents come from text files (a file is a document), folders of them, JSON lines (one
document per line, its `text_field`: `.jsonl` files, and `.json` files named as inputs; a
`.json` met in a folder is a document) and Parquet files (that column, read with pyarrow). They
are taken in order and cut into chunks of about `shard_mb` MB of text; chunk k is tokenised
(EOS before each document, as llm.c does) and written as shard k, `shard_{k:06d}.bin`, by one of
`workers` processes. A shard depends only on its chunk, so a prepare interrupted and run
again skips the shards `progress.json` records whole and rewrites the rest: the same shards.
At the end, `index.json` (shards, token and document counts, largest id, the tokenizer's
identity) and the tokenizer itself (`tokenizer/`) are written beside them.
"""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from itertools import chain, islice
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from meshtrain.data.shards import DataError, dtype_for_vocab, read_header, write_shard
from meshtrain.data.tokenizer import Tokenizer

INDEX, PROGRESS = "index.json", "progress.json"
VERSION = 1   # the index's and shards' format: a cache made under another one is rebuilt
ENCODE_CHARS = 2**18   # text handed to the tokenizer at once
JSON_LINES, PARQUET = (".jsonl",), (".parquet",)


@dataclass(frozen=True)
class Settings:
    """What decides the shards: a prepare resumes only under the same settings."""
    inputs: tuple[str, ...]
    tokenizer_sha256: str
    eos: str
    text_field: str
    shard_mb: float


def prepare(inputs: list[str], tokenizer_path, out, workers: int = 1, shard_mb: float = 64.0,
            text_field: str = "text", eos: str | None = None,
            progress: Callable[[int], None] | None = None) -> dict:
    """Tokenise `inputs` into shards in `out` (module docstring); returns the index.
    `progress(characters)` is called with each shard's text as it is done (or found done)."""
    tok = Tokenizer(tokenizer_path, eos)
    if not shard_mb > 0 or workers < 1:
        raise DataError(f"--shard-mb {shard_mb} and --workers {workers}: give positive numbers")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(tuple(str(Path(i).resolve()) for i in inputs), tok.sha256, tok.eos,
                        text_field, shard_mb)
    done = _resumable(out, settings)
    # before any shard: workers finish shards out of order, and an interrupt can come first
    _write_json(out / PROGRESS, {"settings": asdict(settings), "done": done})
    dtype = dtype_for_vocab(tok.vocab_size)
    sizes = {}   # characters per chunk, by shard name: what each finished shard reports
    chunks = _sized(_chunks(documents(inputs, text_field), int(shard_mb * 2**20)), sizes,
                    done, progress or (lambda n: None))
    for stats in _run(chunks, done, out, dtype.name, tokenizer_path, tok.eos, workers):
        done[stats["file"]] = stats
        _write_json(out / PROGRESS, {"settings": asdict(settings), "done": done})
        if progress is not None:
            progress(sizes.pop(stats["file"]))
    shards = [done[k] for k in sorted(done)]
    if not shards or sum(s["tokens"] for s in shards) == 0:
        raise DataError(f"no text found in {', '.join(inputs)} (empty documents are left "
                        f"out); give text files, JSON lines with a {text_field!r} field, or "
                        "Parquet files")
    index = {"format": "meshtrain-tokens", "version": VERSION, "shards": shards,
             "tokens": sum(s["tokens"] for s in shards),
             "documents": sum(s["documents"] for s in shards), "dtype": dtype.name,
             "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
             "max_token": max(s["max_token"] for s in shards),
             "tokenizer": tok.identity, "settings": asdict(settings)}
    tok.save(out / "tokenizer")
    _write_json(out / INDEX, index)
    return index


def documents(inputs: list[str], text_field: str = "text") -> Iterator[str]:
    """Every document of `inputs` that holds text, in order (a folder's files sorted by
    path); an empty one would add only an EOS."""
    from meshtrain.data.corpus import _is_text, _walk

    def wanted(p: Path) -> bool:
        return p.suffix in JSON_LINES + PARQUET + (".arrow",) or _is_text(p)

    for name in inputs:
        path = Path(name)
        if not path.exists():
            raise DataError(f"{name}: no such file or folder")
        if path.is_file():   # a .json named here is JSON lines; in a folder, a document
            yield from filter(None, _documents_of(path, text_field, path.suffix == ".json"))
            continue
        for file in _walk(path, wanted, lambda n: n.startswith(".")):
            yield from filter(None, _documents_of(file, text_field))


def _documents_of(path: Path, text_field: str, json_lines: bool = False) -> Iterator[str]:
    if path.suffix == ".arrow":
        raise DataError(f"{path}: a Hugging Face datasets folder (save_to_disk's Arrow files) "
                        "is not read; write it as Parquet or JSON lines first "
                        "(dataset.to_parquet(PATH) or dataset.to_json(PATH)) and give those")
    if path.suffix in JSON_LINES or json_lines:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _field(path, number, line, text_field)
    elif path.suffix in PARQUET:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow; pip install "
                            "'meshtrain[data]' (or pip install pyarrow)") from None
        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            raise DataError(f"{path}: no column {text_field!r} (columns: "
                            f"{', '.join(table.schema_arrow.names)}); name it with --text-field")
        for batch in table.iter_batches(columns=[text_field]):
            yield from (t for t in batch.column(0).to_pylist() if t)
    else:
        yield _text_of(path)


def _text_of(path: Path) -> str:
    """A text file's text: a binary file or one not in UTF-8 is refused, not tokenised as
    replacement characters (a folder's binary files are skipped before this)."""
    from meshtrain.data.corpus import binary_file, looks_binary

    data = path.read_bytes()
    if looks_binary(data):
        raise DataError(f"{binary_file(path)}; leave it out")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}, "
                        f"offset {exc.start}); convert it first, e.g. iconv -f latin1 -t utf-8 "
                        "(naming its encoding)") from None


def _field(path: Path, number: int, line: str, text_field: str) -> str:
    try:
        text = json.loads(line)[text_field]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{path}:{number}: not a JSON object with a string {text_field!r} "
                        "field; fix the line, or name the field with --text-field") from None
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: {text_field!r} is a {type(text).__name__}, not text")
    return text


def _chunks(docs: Iterator, chunk_chars: int, size=len) -> Iterator[list]:
    """Documents in consecutive chunks of at least `chunk_chars` characters (the last less;
    `size(doc)` a document's)."""
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += size(doc)
        if chars >= chunk_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _sized(chunks: Iterator[list[str]], sizes: dict, done: dict, progress):
    """The chunks, each one's characters noted in `sizes` by its shard's name; those of
    shards already done (a resumed prepare) reported to `progress` at once."""
    for k, chunk in enumerate(chunks):
        chars = sum(map(len, chunk))
        if _name(k) in done:
            progress(chars)
        else:
            sizes[_name(k)] = chars
        yield chunk


def input_bytes(inputs: list[str]) -> int | None:
    """The inputs' size on disk, a progress bar's total for the text they hold (characters:
    as many for ASCII); None where Parquet's compression makes it no measure."""
    files = [p for name in inputs for p in ([Path(name)] if Path(name).is_file()
                                            else Path(name).rglob("*")) if p.is_file()]
    if any(p.suffix in PARQUET for p in files):
        return None
    return sum(p.stat().st_size for p in files)


def _resumable(out: Path, settings: Settings) -> dict:
    """The shards an earlier prepare into `out` finished whole, by file name."""
    path = out / PROGRESS
    if not path.exists():
        if any(out.glob("shard_*.bin")):
            raise DataError(f"{out} holds shards but no {PROGRESS}: not a prepare this "
                            "command can resume; give an empty or new --out folder")
        return {}
    saved = json.loads(path.read_text())
    if saved.get("settings") != json.loads(json.dumps(asdict(settings))):
        raise DataError(f"{out} holds a prepare of other inputs or settings ({path}); give "
                        "another --out folder, or delete this one to start again")
    whole = {}
    for name, stats in saved.get("done", {}).items():
        try:
            if read_header(out / name)[1] == stats["tokens"]:
                whole[name] = stats
        except (DataError, OSError):
            pass   # damaged or missing: made again
    return whole


def _run(chunks, done: dict, out: Path, dtype: str, tokenizer_path, eos: str, workers: int):
    """Each chunk's shard stats, in order: made by `workers` processes (in this one for 1),
    with at most 2 chunks per worker in flight, so memory stays bounded."""
    todo = ((k, c) for k, c in enumerate(chunks) if _name(k) not in done)
    if workers == 1:
        _init(str(tokenizer_path), eos)
        yield from (_make_shard(k, c, str(out), dtype) for k, c in todo)
        return
    ctx = get_context("spawn")   # the tokenizers library's threads do not survive a fork
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                               initargs=(str(tokenizer_path), eos))
    try:
        pending = []
        for k, chunk in todo:
            pending.append(pool.submit(_make_shard, k, chunk, str(out), dtype))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()
    except BaseException:   # Ctrl-C, a bad document: the queued chunks are not started
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


_TOKENIZER: Tokenizer | None = None   # a worker process's own, loaded once


def _init(tokenizer_path: str, eos: str) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer(tokenizer_path, eos)


def _make_shard(k: int, texts: list[str], out: str, dtype: str) -> dict:
    """Shard k from its chunk's texts, EOS before each, encoded ENCODE_CHARS at a time (a
    longer document in pieces): the library's encodings (offsets, strings, masks) take some
    hundreds of bytes a token, the ids kept here 2 or 4."""
    eos = np.asarray([_TOKENIZER.eos_id], dtype=dtype)
    pieces = [(piece, i == 0) for text in texts for i, piece in enumerate(_split(text))]
    parts = []
    for group in _chunks(iter(pieces), ENCODE_CHARS, size=lambda piece: len(piece[0])):
        for (_, first), ids in zip(group, _TOKENIZER.encode_batch([p for p, _ in group])):
            if first:   # a document's first piece
                parts.append(eos)
            parts.append(np.asarray(ids, dtype=dtype))
    tokens = np.concatenate(parts)
    write_shard(Path(out) / _name(k), tokens, np.dtype(dtype))
    return {"file": _name(k), "tokens": int(tokens.size), "documents": len(texts),
            "max_token": int(tokens.max())}


_WORD_END = re.compile(r"\S(?=\s)")
_TRIES = 8   # cuts tried in a window (then as many past it) before a text is left whole


def _split(text: str, size: int | None = None, exact=None) -> list[str]:
    """`text` in pieces of about `size` characters, each cut at a word's end (a non-space
    before a space or newline) where `exact(text, cut)` finds the ids around the cut equal
    cut or whole: a regex pre-tokenizer's (GPT-2's, Llama 3's) always are; a tokenizer that
    marks the start of each input, or merges across spaces, is left uncut."""
    size, exact = size or ENCODE_CHARS, exact or _exact_cut
    pieces, start = [], 0
    while len(text) - start > size:
        ends = [m.end() for m in _WORD_END.finditer(text, start + size // 2, start + size)]
        later = (m.end() for m in _WORD_END.finditer(text, start + size))
        tries = chain(reversed(ends[-_TRIES:]), islice(later, _TRIES))
        cut = next((c for c in tries if exact(text, c)), None)
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    return pieces + [text[start:]]


def _exact_cut(text: str, cut: int, width: int = 256) -> bool:
    """The ids of the text around `cut` are the same encoded whole or in two."""
    left, right = text[max(cut - width, 0):cut], text[cut:cut + width]
    return _TOKENIZER.encode(left + right) == _TOKENIZER.encode(left) + _TOKENIZER.encode(right)


def _name(k: int) -> str:
    return f"shard_{k:06d}.bin"


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
