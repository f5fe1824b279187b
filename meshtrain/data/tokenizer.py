"""The model's tokenizer, as the `tokenizers` library reads it: a `tokenizer.json`, or a
transformers tokenizer folder holding one. Its identity (the file's SHA-256, vocabulary, EOS)
goes into every dataset's index and run folder, so that data, model and generation agree.

A saved tokenizer (`save`) is a folder `AutoTokenizer.from_pretrained` loads: tokenizer.json
and a tokenizer_config.json naming its EOS.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from meshtrain.data.shards import DataError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
"""Special tokens taken as the end of a document, in this order, where the tokenizer's
config names none."""
_CONFIG = "tokenizer_config.json"


class Tokenizer:
    """A `tokenizers.Tokenizer` with its EOS and identity."""

    def __init__(self, path, eos: str | None = None) -> None:
        from tokenizers import Tokenizer as _Backend

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(_missing(path))
        self.file = file
        self.config = _read_config(folder / _CONFIG) if path.is_dir() or \
            file.name == "tokenizer.json" else {}
        try:
            self.backend = _Backend.from_file(str(file))
        except Exception as exc:   # noqa: BLE001 - the library raises its own Exception type
            raise DataError(f"--tokenizer {path}: the tokenizers library cannot read "
                            f"{file.name} ({exc}); give a tokenizer.json or a transformers "
                            "tokenizer folder") from None
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eos = eos or _eos_of(self.config) or next(
            (t for t in EOS_CANDIDATES if self.backend.token_to_id(t) is not None), None)
        if self.eos is None or self.backend.token_to_id(self.eos) is None:
            raise DataError(f"--tokenizer {path}: no end-of-document token found "
                            f"({self.eos or 'none of ' + ', '.join(EOS_CANDIDATES)}); name the "
                            "tokenizer's own: `meshtrain prepare --eos TOKEN` (then --data the "
                            "prepared folder), or \"eos_token\" in the tokenizer_config.json "
                            "beside its tokenizer.json")
        self.eos_id = self.backend.token_to_id(self.eos)
        self.sha256 = hashlib.sha256(file.read_bytes()).hexdigest()

    @property
    def identity(self) -> dict:
        """What a dataset's index and a run record of the tokenizer."""
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "eos": self.eos,
                "eos_id": self.eos_id}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, encoded in parallel by the library."""
        return [enc.ids for enc in self.backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def save(self, folder) -> None:
        """tokenizer.json and tokenizer_config.json in `folder` (AutoTokenizer loads it)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.file.resolve() != (folder / "tokenizer.json").resolve():
            shutil.copyfile(self.file, folder / "tokenizer.json")
        config = dict(self.config, eos_token=self.eos)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        (folder / _CONFIG).write_text(json.dumps(config, indent=1))


def check_matches(tokenizer: Tokenizer, index: dict | None, where: str) -> None:
    """Refuse a tokenizer other than the one that made the dataset (its index's record)."""
    made = (index or {}).get("tokenizer")
    if made and made.get("sha256") != tokenizer.sha256:
        raise DataError(f"--tokenizer {tokenizer.file}: not the tokenizer that made {where} "
                        f"(its index records sha256 {made.get('sha256', '?')[:12]}..., "
                        f"vocabulary {made.get('vocab_size')}; this one is "
                        f"{tokenizer.sha256[:12]}..., {tokenizer.vocab_size}); train with the "
                        "dataset's own (saved in its tokenizer/ folder) or prepare it again")


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _eos_of(config: dict) -> str | None:
    eos = config.get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _missing(path: Path) -> str:
    if path.is_dir():
        return (f"--tokenizer {path}: the folder holds no tokenizer.json; give a fast "
                "(tokenizers-library) tokenizer, e.g. one saved by transformers' "
                "tokenizer.save_pretrained")
    return (f"--tokenizer {path}: no such file; give a tokenizer.json or a tokenizer folder "
            "(a tiktoken encoding by name is not read: save its transformers equivalent with "
            "AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR) and give DIR)")
