"""`meshtrain train --data`, opened in the command's process before any rank starts: what no
rank could train on is refused here, naming the file, and a GPT preset's vocabulary follows
the token dataset's."""
from __future__ import annotations

from meshtrain.core.plan import PlanError

VOCAB_MULTIPLE = 64
"""A GPT preset's vocabulary is rounded up to this (nanoGPT's 50,257 -> 50,304: whole tiles)."""


def settle_data(config) -> None:
    """Check `config.data` against the model and, on resume, against the checkpoint's data;
    set `config.model_overrides["vocab_size"]` for a GPT preset training on tokens."""
    if config.data is None:
        return
    from meshtrain.data.source import load_data

    data = load_data(config.data)   # every shard's header checked; DataError names the file
    if not data.tokens:
        return
    vocab = model_vocab(config)
    declared = data.vocab_size
    if vocab is None and config.model_overrides.get("vocab_size") is None and _is_gpt(config):
        need = declared or data.max_token + 1
        config.model_overrides["vocab_size"] = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return
    if vocab is None:
        return   # the user's own model: ids beyond its embedding are refused when read
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


def _is_gpt(config) -> bool:
    from meshtrain.models.registry import kind_of

    return kind_of(config.model) == "gpt"


def _file_with_max(t) -> str:
    from meshtrain.data.tokens import scan_max_token

    if t.index is not None and len(t.files) > 1:
        return f"{t.files[0].rsplit('/', 1)[0]} (its index's max_token)"
    return max(t.files, key=scan_max_token) if len(t.files) > 1 else t.files[0]
