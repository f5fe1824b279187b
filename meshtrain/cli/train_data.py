"""`meshtrain train --data`, opened in the command's process before any rank starts: what no
rank could train on is refused here, naming the file, and a GPT preset's vocabulary follows
the token dataset's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from meshtrain.core.plan import PlanError

VOCAB_MULTIPLE = 64
"""A GPT preset's vocabulary is rounded up to this (nanoGPT's 50,257 -> 50,304: whole tiles)."""


def settle_data(config):
    """Check `config.data` (and `config.tokenizer`) against the model and each other; text
    with a tokenizer is tokenised once into a cache folder, which `config.data` then names;
    a GPT preset's vocabulary is set to the data's, another model's sequence length to its
    context (at most 2048) where --seq left it open. Returns the run's tokenizer (the one
    given, else the one a prepared dataset carries), or None for bytes."""
    from meshtrain.data.source import check_fits, load_data
    from meshtrain.data.tokenizer import Tokenizer, check_matches
    from meshtrain.data.tokens import is_token_data

    text = config.data is not None and "," not in config.data and not is_token_data(config.data)
    if config.tokenizer is None and text and (found := model_tokenizer(config)) is not None:
        config.tokenizer = str(found)
        print(f"meshtrain train: --data is text, read with the model's tokenizer ({found}; "
              "--tokenizer names another)", file=sys.stderr)
    if config.seq_len is None and not config.resume and not _is_gpt(config):
        config.seq_len = run_seq_len(config)   # a long context capped; the ranks take it
    tok = Tokenizer(config.tokenizer) if config.tokenizer else None
    if config.data is None:
        if tok is None and config.init_from and model_tokenizer(config) is not None:
            print("meshtrain train: the default data is this Python's source as bytes, not "
                  f"the tokens {config.init_from}'s weights were trained on: give --data "
                  "text to read it with the model's tokenizer", file=sys.stderr)
        if tok is not None:
            raise PlanError("--tokenizer needs --data: text to tokenise, or token shards")
        return None
    if tok is not None and text:
        config.data = str(tokenize_once(config.data, tok, config.progress))
    data = load_data(config.data)   # every shard's header checked; DataError names the file
    seq_len = run_seq_len(config)
    if seq_len is not None:   # a split without one window would fail on every rank
        check_fits(data, seq_len)
    if not data.tokens:
        return None
    if tok is None and (beside := model_tokenizer(config)) is not None:
        _check_model_tokenizer(Tokenizer(beside), data, beside)
    for t in data.tokens:
        if tok is not None:
            check_matches(tok, t.index, str(Path(t.files[0]).parent))
        elif t.index and (Path(t.files[0]).parent / "tokenizer" / "tokenizer.json").exists():
            tok = Tokenizer(Path(t.files[0]).parent / "tokenizer")   # the dataset's own
    declared = max(filter(None, [data.vocab_size, tok and tok.vocab_size]), default=None)
    vocab = model_vocab(config)
    if vocab is None and config.model_overrides.get("vocab_size") is None and _is_gpt(config):
        need = declared or data.max_token + 1
        config.model_overrides["vocab_size"] = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab is not None:
        _check_vocab(config, data, declared, vocab)
    return tok


def model_tokenizer(config) -> Path | None:
    """The folder the model comes from (--init-from's, or --model's folder or config.json's),
    where it holds a tokenizer.json, as save_pretrained writes a tokenizer beside a model."""
    from meshtrain.models.registry import kind_of

    model = config.model if config.model and kind_of(config.model) == "transformers" else None
    for place in filter(None, (config.init_from, model)):
        folder = Path(place) if Path(place).is_dir() else Path(place).parent
        if (folder / "tokenizer.json").is_file():
            return folder
    return None


def _check_model_tokenizer(model_tok, data, folder: Path) -> None:
    """Token data for a model folder holding its own tokenizer (--init-from, --model FOLDER)
    must be made by that tokenizer: other ids would train silently, and the run, generate
    and export would carry the data's tokenizer beside weights learnt with another."""
    for t in data.tokens:
        made = (t.index or {}).get("tokenizer")
        if made and made.get("sha256") != model_tok.sha256:
            where = Path(t.files[0]).parent
            raise PlanError(f"--data {where}: made by another tokenizer than the model's "
                            f"({folder / 'tokenizer.json'}; the data's has vocabulary "
                            f"{made.get('vocab_size')}, the model's {model_tok.vocab_size}); "
                            f"prepare it with the model's (meshtrain prepare ... --tokenizer "
                            f"{folder}), or name the data's with --tokenizer to train with it")


def tokenize_once(spec: str, tok, progress: bool = False) -> Path:
    """Text `spec` as token shards in the cache (`cache_dir()/<key>`), prepared
    on first use (with a progress bar); the key is the files' paths, sizes and times, the
    tokenizer's identity (hash, vocabulary, EOS) and the tokens' format version. A cache
    whose index says another format or tokenizer made it is rebuilt, never reused."""
    import hashlib
    import os
    import shutil

    from meshtrain.data.prepare import INDEX, VERSION, prepare
    from meshtrain.data.tokens import cache_dir

    files = [spec] if Path(spec).is_file() else sorted(
        str(p) for p in Path(spec).rglob("*") if p.is_file())
    stamp = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    made_by = {"version": VERSION, "tokenizer": tok.identity}
    key = hashlib.sha256(json.dumps([stamp, made_by]).encode()).hexdigest()[:16]
    out = cache_dir() / key
    index = _read_index(out / INDEX)
    if index is not None and {k: index.get(k) for k in made_by} != made_by:
        print(f"meshtrain train: {out} was made by another meshtrain or tokenizer; "
              "rebuilding it", file=sys.stderr)
        shutil.rmtree(out)
        index = None
    if index is None:
        from meshtrain.cli.prepare_cmd import progress_bar

        print(f"meshtrain train: tokenising {spec} once, into {out}", file=sys.stderr)
        with progress_bar([spec], progress) as bar:
            prepare([spec], tok.file, out, eos=tok.eos, progress=bar.update)
    return out


def _read_index(path: Path) -> dict | None:
    """A cache's index.json; None where there is none (an unreadable one counts as stale)."""
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _check_vocab(config, data, declared: int | None, vocab: int) -> None:
    if declared is not None and declared > vocab:
        raise PlanError(f"--data {config.data}: its tokenizer has {declared:,} words, more than "
                        f"the model's vocabulary of {vocab:,}; use a model whose embedding holds "
                        "the tokenizer's vocabulary")
    for t in data.tokens:
        if t.max_token >= vocab:
            raise PlanError(f"--data {config.data}: {_file_with_max(t)} holds token id "
                            f"{t.max_token}, at or above the model's vocabulary of {vocab:,}; "
                            "use a model with a larger vocabulary, or data made by its tokenizer")


def check_resumed_data(config, meta: dict) -> None:
    """The checkpoint's data position was taken on the same datasets (names, token counts)."""
    saved = (meta.get("extra") or {}).get("data")
    if not saved or saved.get("fingerprint") == "bytes":   # text: checked by its path only
        return
    from meshtrain.data.source import load_data

    now = load_data(config.data).fingerprint
    if saved.get("fingerprint") != now:
        raise PlanError(f"--data {config.data}: the data differs from what the checkpoint "
                        f"was trained on (identity {saved.get('fingerprint')}, now {now}): "
                        "files were added, removed or rewritten; resume with the run's own "
                        "data, or start a new run")


def model_vocab(config) -> int | None:
    """The model's vocabulary where the command can know it without building the model: a
    GPT preset with a vocab_size override, or a transformers config; else None."""
    from meshtrain.models.registry import kind_of, transformers_config

    kind = kind_of(config.model)
    if kind == "gpt":
        return config.model_overrides.get("vocab_size")
    if kind in ("transformers", "hf-preset"):
        return int(transformers_config(config.model).vocab_size)
    return None


def run_seq_len(config) -> int | None:
    """The run's sequence length where the command can know it without building the model
    (as models.registry.build_model settles it); None for a callable without --seq."""
    from meshtrain.models.gpt import gpt_config
    from meshtrain.models.registry import (context_of, default_seq, kind_of,
                                           transformers_config)

    kind = kind_of(config.model)
    if kind == "gpt":
        return gpt_config(config.model, **config.model_overrides).seq_len
    if kind in ("transformers", "hf-preset"):
        return config.seq_len or default_seq(context_of(transformers_config(config.model)))
    return config.seq_len


def _is_gpt(config) -> bool:
    from meshtrain.models.registry import kind_of

    return kind_of(config.model) == "gpt"


def _file_with_max(t) -> str:
    from meshtrain.data.shards import max_token

    if t.index is not None and len(t.files) > 1:
        return f"{t.files[0].rsplit('/', 1)[0]} (its index's max_token)"
    return max(t.files, key=max_token) if len(t.files) > 1 else t.files[0]
