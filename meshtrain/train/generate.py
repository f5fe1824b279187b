"""Text from a trained run: the latest checkpoint, one process, whatever plan trained it
(checkpoints hold the consolidated one-process state); or from a transformers model folder.

    model, seq_len, step = load_trained("runs/2026-11-23_10-00-00")
    text = generate(model, "def ", tokens=200, seq_len=seq_len, temperature=0.8, top_k=40)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from meshtrain.models.registry import BYTE_VOCAB, build_model, logits_of
from meshtrain.train.config import RunConfig, latest_checkpoint
from meshtrain.train.errors import CheckpointError


def load_trained(run_dir) -> tuple[nn.Module, int, int | None]:
    """The run's model with its latest checkpoint's weights, in eval mode: (model, context
    length, steps trained); or a transformers model folder's (what `meshtrain export` or
    save_pretrained writes: its context up to 2048, steps None)."""
    from meshtrain.train import checkpoint
    from meshtrain.core.state import StateLayout

    if is_model_folder(run_dir):
        return _load_model_folder(Path(run_dir))
    config = RunConfig.load(run_dir)
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (checkpoints/latest is "
                              "missing): let the run reach a checkpoint, or train it to the end")
    built = build_model(config.model, config.model_overrides, config.seq_len)
    layout = StateLayout.of(built.module)
    model_state, _, extra = checkpoint.load(path, layout)
    built.module.load_state_dict(model_state)
    return built.module.eval(), built.seq_len, int(extra.get("steps_done", 0))


def is_model_folder(path) -> bool:
    """A transformers model folder (its config.json names a model_type), not a run folder."""
    config = Path(path) / "config.json"
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def _load_model_folder(folder: Path) -> tuple[nn.Module, int, None]:
    from transformers import AutoModelForCausalLM

    from meshtrain.models.registry import context_of, default_seq

    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} holds no tokenizer.json: generate needs the model's "
                                "tokenizer to encode the prompt; save it beside config.json "
                                "(tokenizer.save_pretrained(FOLDER))")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: transformers cannot load this model folder "
                              f"({str(exc).splitlines()[0]})") from None
    return model.eval(), default_seq(context_of(model.config)), None


def run_tokenizer(run_dir):
    """The tokenizer the run trained with (its folder's tokenizer/), or a transformers model
    folder's own tokenizer.json; None for bytes."""
    from meshtrain.data.tokenizer import Tokenizer

    folder = Path(run_dir) / "tokenizer"
    if (folder / "tokenizer.json").exists():
        return Tokenizer(folder)
    return Tokenizer(Path(run_dir)) if is_model_folder(run_dir) else None


@torch.no_grad()
def generate(model: nn.Module, prompt: str, tokens: int, seq_len: int,
             temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
             on_token=None, tokenizer=None, stop_at_eos: bool = True) -> bytes:
    """Up to `tokens` tokens sampled after `prompt`, each from the model's next-token
    distribution over the last `seq_len` tokens: logits / temperature, then only the top_k
    most likely (temperature 0 takes the most likely). Tokens are bytes (UTF-8), or the ids
    of `tokenizer` (the run's), decoded at the end; with a tokenizer the sample ends where the
    model emits its end-of-document token (left out of the text) unless `stop_at_eos` is
    False. `on_token(id)` sees each as it is drawn."""
    check_sampling(tokens, temperature, top_k)
    if tokenizer is None:
        context, vocab = list(prompt.encode("utf-8")) or [ord("\n")], BYTE_VOCAB
    else:   # an empty prompt starts a document
        context, vocab = tokenizer.encode(prompt) or [tokenizer.eos_id], tokenizer.vocab_size
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for _ in range(tokens):
        window = torch.tensor([context[-seq_len:]], dtype=torch.long, device=device)
        logits = logits_of(model(window))[0, -1, :vocab].float().cpu()  # host generator
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                cutoff = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if stop_at_eos and tokenizer is not None and token == tokenizer.eos_id:
            break   # the document ended (a byte-level run has no such token)
        context.append(token)
        out.append(token)
        if on_token is not None:
            on_token(token)
    return bytes(out) if tokenizer is None else tokenizer.decode(out).encode("utf-8")


def check_sampling(tokens: int, temperature: float, top_k: int | None) -> None:
    if tokens < 1:
        raise ValueError(f"--tokens {tokens}: give how many tokens to generate (>= 1)")
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0 takes the most likely "
                         "token, 1 samples the model's own distribution)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k {top_k}: must be >= 1 (or leave it out for no cut)")
