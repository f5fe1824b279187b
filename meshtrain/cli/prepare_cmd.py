"""`meshtrain prepare INPUT... --tokenizer T --out DIR`: text into token shards, once, with the
model's tokenizer; `meshtrain train --data DIR` then reads them memory-mapped.

    meshtrain prepare books/ notes.jsonl --tokenizer my-tokenizer/ --out data/books
    meshtrain prepare web/*.parquet --tokenizer tokenizer.json --out data/web --workers 8

Inputs: text files (each one document), folders of them, JSON lines and Parquet files (one
document per line or row, from --text-field). Each document starts with the tokenizer's EOS;
shards are llm.c's format (uint16 ids, uint32 for vocabularies over 65,536). Interrupted, the
same command resumes and makes the same shards.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise text into token shards for --data",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, folders, .jsonl or .parquet files")
    p.add_argument("--tokenizer", required=True,
                   help="the model's tokenizer: a tokenizer.json or a transformers tokenizer "
                        "folder holding one")
    p.add_argument("--out", required=True, help="the dataset folder to write (or resume)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    p.add_argument("--shard-mb", type=float, default=64.0,
                   help="text per shard, in MB (default 64: about 16M tokens)")
    p.add_argument("--text-field", default="text",
                   help="the JSON lines field or Parquet column holding the text")
    p.add_argument("--eos", help="the end-of-document token (default: the tokenizer's own)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def progress_bar(inputs: list[str], enabled: bool = True):
    """Text tokenised, in characters, against the inputs' bytes: a rate and an ETA."""
    from tqdm import tqdm

    from meshtrain.data.prepare import input_bytes

    return tqdm(desc="prepare", unit="B", unit_scale=True, disable=not enabled,
                total=input_bytes(inputs) if enabled else None, file=sys.stderr)


def run(args) -> int:

    from meshtrain.data.prepare import prepare
    from meshtrain.data.shards import DataError

    bar = progress_bar(args.inputs, enabled=not args.no_progress)
    try:
        index = prepare(args.inputs, args.tokenizer, args.out, args.workers, args.shard_mb,
                        args.text_field, args.eos, progress=bar.update)
    except (DataError, OSError) as exc:
        bar.close()
        if isinstance(exc, OSError) and not exc.filename:   # numpy's writes name no file
            exc = f"writing into {args.out}: {exc.strerror or exc}"
        print(f"meshtrain prepare: {exc}", file=sys.stderr)
        return 2
    bar.close()
    print(f"{args.out}: {len(index['shards'])} shard(s), {index['tokens']:,} tokens "
          f"({index['dtype']}), {index['documents']:,} documents, vocabulary "
          f"{index['vocab_size']:,}, EOS id {index['eos_id']}")
    return 0
