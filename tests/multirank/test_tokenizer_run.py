"""The tokenizer follows the run: text given with --tokenizer is tokenised once into a cache,
the run folder keeps the tokenizer, `export` writes it beside the model (AutoTokenizer loads
it), `generate` encodes the prompt and decodes the output with it; a tokenizer larger than
the model's embedding, or other than the dataset's, is refused before any rank starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.cli.main import main
from meshtrain.data.tokenizer import Tokenizer
from tests.unit.test_prepare import DOCS, train_tokenizer

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from meshtrain.models.hf_presets import config_of

    root = tmp_path_factory.mktemp("tokrun")
    tok = train_tokenizer(root / "tokenizer.json", vocab_size=300)
    (root / "texts").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "texts" / f"{i:02d}.txt").write_text(doc * 3)
    config = config_of("llama-tiny")
    config.vocab_size = 320
    config.save_pretrained(str(root / "llama320"))
    env = dict(os.environ, XDG_CACHE_HOME=str(root / "cache"))
    run = root / "run"
    out = subprocess.run([str(BIN / "meshtrain"), "train", "--model",
                          str(root / "llama320" / "config.json"), "--data", str(root / "texts"),
                          "--tokenizer", str(tok), "--nproc", "1", "--steps", "2", "--seq",
                          "32", "--batch", "4", "--no-progress", "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    return root, tok, run


def test_text_is_tokenised_once_and_the_run_keeps_its_tokenizer(setup):
    root, tok, run = setup
    data = Path(json.loads((run / "config.json").read_text())["data"])
    assert data.parent == root / "cache" / "meshtrain" / "tokens"
    index = json.loads((data / "index.json").read_text())
    assert index["documents"] == len(DOCS) and index["vocab_size"] == 300
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_export_and_generate_use_the_runs_tokenizer(setup, tmp_path, capsys):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from meshtrain.train.generate import load_trained

    _, tok, run = setup
    assert main(["export", str(run), str(tmp_path / "model")]) == 0
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    own = Tokenizer.from_file(str(tok))
    assert auto.encode(DOCS[5], add_special_tokens=False) == own.encode(DOCS[5]).ids
    capsys.readouterr()
    prompt = "the quick brown"
    assert main(["generate", str(run), "--prompt", prompt, "--tokens", "6",
                 "--temperature", "0"]) == 0
    model, seq_len, _ = load_trained(run)
    context = own.encode(prompt).ids
    for _ in range(6):   # greedy by hand, over the tokenizer's vocabulary
        with torch.no_grad():
            logits = model(torch.tensor([context[-seq_len:]])).logits[0, -1, :300]
        context.append(int(logits.argmax()))
    printed = capsys.readouterr().out
    assert printed == prompt + own.decode(context[len(own.encode(prompt).ids):]) + "\n"


def test_a_tokenizer_the_model_or_the_data_cannot_take_is_refused(setup, tmp_path, capsys,
                                                                  monkeypatch):
    root, tok, run = setup
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    argv = ["train", "--nproc", "1", "--steps", "1", "--no-progress",
            "--run-dir", str(tmp_path / "r")]
    assert main(argv + ["--model", "llama-tiny", "--data", str(root / "texts"),
                        "--tokenizer", str(tok)]) == 2
    assert "its tokenizer has 300 words, more than the model's vocabulary of 256" in \
        capsys.readouterr().err
    other = train_tokenizer(tmp_path / "other.json", vocab_size=290)
    dataset = json.loads((run / "config.json").read_text())["data"]
    assert main(argv + ["--data", dataset, "--tokenizer", str(other)]) == 2
    assert f"--tokenizer {other}: not the tokenizer that made {dataset}" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_text_data_is_read_with_the_model_folders_tokenizer(setup, tmp_path, monkeypatch,
                                                            capsys):
    import shutil

    from meshtrain.cli.main import build_parser
    from meshtrain.cli.train_cmd import build_config
    from meshtrain.cli.train_data import settle_data

    root, tok, _ = setup
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    folder = tmp_path / "model"   # as save_pretrained leaves a model and its tokenizer
    shutil.copytree(root / "llama320", folder)
    shutil.copy(tok, folder / "tokenizer.json")
    for model in (str(folder), str(folder / "config.json")):
        config = build_config(build_parser().parse_args(
            ["train", "--model", model, "--data", str(root / "texts"), "--nproc", "1"]))
        assert settle_data(config).sha256 == Tokenizer(tok).sha256
        assert json.loads((Path(config.data) / "index.json").read_text())["vocab_size"] == 300
        assert "read with the model's tokenizer" in capsys.readouterr().err
    # pretrained weights on the default data (bytes): said, not silent
    config = build_config(build_parser().parse_args(["train", "--init-from", str(folder)]))
    assert settle_data(config) is None
    assert "not the tokens" in capsys.readouterr().err
    # without a tokenizer beside the model, text stays bytes
    config = build_config(build_parser().parse_args(
        ["train", "--model", str(root / "llama320"), "--data", str(root / "texts")]))
    assert settle_data(config) is None and config.tokenizer is None
