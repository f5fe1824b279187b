"""What `meshtrain train --data` names, opened: the byte corpus (corpus.py), token datasets
(tokens.py), or several token datasets blended by weight.

    --data                          this Python's standard library, as bytes (no setup)
    --data book.txt | texts/        text, as bytes
    --data shards/ | x.bin | 'd/*.bin'   token shards, memory-mapped
    --data web/@0.7,code/@0.3       token datasets blended: 70% of the rows from web/
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.data.corpus import load_corpus
from meshtrain.data.sampler import as_tokens
from meshtrain.data.shards import DataError
from meshtrain.data.tokens import TokenData, TokenStream, is_token_data, open_tokens


@dataclass(frozen=True, eq=False)
class TrainingData:
    train: list
    """One token stream (or byte tensor) per dataset."""
    weights: list[float] | None
    """Blend weights, one per dataset (None: one dataset)."""
    val: object
    """The validation split: every dataset's, one after the other."""
    source: str
    fingerprint: str
    """The datasets' identity (file names and token counts); "bytes" for text."""
    tokens: tuple[TokenData, ...]
    """The token datasets (empty for text read as bytes)."""

    @classmethod
    def of_corpus(cls, corpus) -> "TrainingData":
        """Text read as bytes (corpus.py's Corpus)."""
        return cls([corpus.train], None, corpus.val, corpus.source, "bytes", ())

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the datasets declare (their indexes), the largest; None if none do."""
        sizes = [t.vocab_size for t in self.tokens if t.vocab_size is not None]
        return max(sizes) if sizes else None

    @property
    def max_token(self) -> int:
        """The largest id in the data (255 for bytes); may scan bare shards once."""
        return max((t.max_token for t in self.tokens), default=255)


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """"a@0.7,b@0.3" -> [("a", 0.7), ("b", 0.3)]; a single path -> [(path, 1.0)]."""
    parts = []
    for item in spec.split(","):
        path, at, weight = item.rpartition("@") if "@" in item else (item, "", "1")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not path or not w > 0:
            raise DataError(f"--data {spec}: {item!r} is not PATH or PATH@WEIGHT with a "
                            "positive weight, e.g. web/@0.7,code/@0.3")
        parts.append((path, w))
    return parts


def load_data(spec: str | None, vocab_size: int | None = None) -> TrainingData:
    """The data `spec` names (module docstring); token ids at or above `vocab_size` (the
    model's) are refused when read."""
    parts = parse_blend(spec) if spec is not None else []
    if not parts or (len(parts) == 1 and not is_token_data(parts[0][0])):
        return TrainingData.of_corpus(load_corpus(spec))
    text = [p for p, _ in parts if not is_token_data(p)]
    if text:
        raise DataError(f"--data {spec}: {text[0]} is text; a blend takes token datasets "
                        "(prepare it with `meshtrain prepare`)")
    tokens = tuple(open_tokens(p, vocab_size) for p, _ in parts)
    val = TokenStream([piece for t in tokens for piece in t.val.pieces], vocab_size)
    weights = [w for _, w in parts] if len(parts) > 1 else None
    total = sum(weights or [1.0])
    source = " + ".join(t.source + (f" at {w / total:.0%}" if weights else "")
                        for t, w in zip(tokens, weights or [1.0]))
    return TrainingData([t.train for t in tokens], weights, val, source,
                        ",".join(t.fingerprint for t in tokens), tokens)


def check_fits(data: TrainingData, seq_len: int) -> None:
    """Raise a clear error unless every split holds a window of seq_len+1 tokens (inside
    one shard: a window never crosses two)."""
    unit = "tokens" if data.tokens else "bytes"
    for name, split in [("train", s) for s in data.train] + [("val", data.val)]:
        split = as_tokens(split)
        if split.num_windows(seq_len) < 1:
            raise DataError(f"{name} split of {data.source} has {split.numel()} {unit}, fewer "
                            f"than seq_len+1={seq_len + 1} in one piece; use more data or a "
                            "shorter --seq")
