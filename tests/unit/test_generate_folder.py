"""`meshtrain generate` from a transformers model folder (what `meshtrain export` and
save_pretrained write): the folder's weights and its tokenizer.json, greedy text equal to the
model's own argmax continuation; a folder without a tokenizer is refused in one line."""
import pytest
import torch

from meshtrain.cli.main import main
from tests.unit.test_prepare import train_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_generate_reads_a_model_folder_with_its_tokenizer(folder, capsys):
    from transformers import AutoModelForCausalLM

    from meshtrain.data.tokenizer import Tokenizer

    assert main(["generate", str(folder), "--tokens", "3"]) == 2   # no tokenizer.json yet
    err = capsys.readouterr().err
    assert "holds no tokenizer.json: generate needs the model's tokenizer" in err
    train_tokenizer(folder / "tokenizer.json")
    assert main(["generate", str(folder), "--prompt", "the quick", "--tokens", "6",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "a transformers model folder: 6 tokens after 'the quick'" in out.err
    tok = Tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = tok.encode("the quick")
    for _ in range(6):   # greedy by hand, over the tokenizer's words
        ids.append(int(model(torch.tensor([ids])).logits[0, -1, :tok.vocab_size].argmax()))
    assert out.out == "the quick" + tok.decode(ids[len(tok.encode("the quick")):]) + "\n"


class Scripted(torch.nn.Module):
    """Says `script` one token per call (its logits one-hot at that id), whatever it reads."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1, device="cpu"))   # generate's device
        self.script, self.vocab, self.calls = script, vocab, 0

    def forward(self, ids):
        logits = torch.zeros(1, ids.shape[1], self.vocab, device=ids.device)
        logits[0, -1, self.script[min(self.calls, len(self.script) - 1)]] = 1.0
        self.calls += 1
        return logits


def test_a_sample_stops_at_the_tokenizers_eos_unless_told_to_go_on(folder, capsys,
                                                                    monkeypatch):
    from meshtrain.data.tokenizer import Tokenizer
    from meshtrain.train import generate

    if not (folder / "tokenizer.json").exists():
        train_tokenizer(folder / "tokenizer.json")
    tok = Tokenizer(folder)
    a, b = tok.encode("fox")[0], tok.encode("dogs")[0]
    script = [a, b, tok.eos_id, a]
    argv = ["generate", str(folder), "--prompt", "the", "--tokens", "6", "--temperature", "0"]
    for extra, said in (([], [a, b]), (["--ignore-eos"], [a, b, tok.eos_id, a, a, a])):
        monkeypatch.setattr(generate, "load_trained",
                            lambda run_dir: (Scripted(script, tok.vocab_size), 64, None))
        assert main(argv + extra) == 0
        out = capsys.readouterr()
        assert out.out == "the" + tok.decode(said) + "\n"
        assert (f"stopped at {tok.eos!r} (the end of a document) after 2 tokens" in out.err) \
            == (not extra)
