"""`meshtrain train --model <transformers config.json>` under --tp 2 and --pp 2, and
`meshtrain export` of its run to a folder transformers loads to the same logits."""
from pathlib import Path

import pytest
import torch

from tests.multirank.test_cli_train import meshtrain, metrics

pytest.importorskip("transformers")
ROOT = Path(__file__).parents[2]
RUN = ["--seq", "16", "--batch", "8", "--steps", "3", "--no-progress", "--eval-every", "100",
       "--ckpt-every", "3", "--nproc", "2"]


def test_llama_config_trains_under_tp_and_pp_and_exports_to_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf_presets import config_of
    from meshtrain.train.generate import load_trained

    config_of("llama-tiny").save_pretrained(tmp_path / "llama")
    spec = str(tmp_path / "llama" / "config.json")
    losses = {}
    for plan in (["--tp", "2"], ["--pp", "2", "--microbatches", "2"]):
        run = tmp_path / plan[0].strip("-")
        out = meshtrain("train", "--model", spec, "--run-dir", str(run), *RUN, *plan, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        losses[plan[0]] = [m["loss"] for m in metrics(run) if "loss" in m]
    assert len(losses["--tp"]) == 3
    # the same seed, batches and model: both plans are the one-process run, within fp32
    torch.testing.assert_close(torch.tensor(losses["--tp"]), torch.tensor(losses["--pp"]),
                               rtol=0, atol=1e-5)
    folder = tmp_path / "exported"
    out = meshtrain("export", str(tmp_path / "tp"), str(folder), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                        "model.safetensors"]
    trained, _, steps = load_trained(tmp_path / "tp")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
    assert steps == 3


def test_bad_transformers_input_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    import importlib
    import json

    from meshtrain.cli.main import main
    from meshtrain.models.hf_presets import config_of

    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "nonesuch", "vocab_size": 300}))
    config_of("llama-tiny").save_pretrained(tmp_path / "llama")
    llama = str(tmp_path / "llama" / "config.json")
    started = []   # in-process: a rank would start only through launch()
    launcher = importlib.import_module("meshtrain.launch")   # the package exports launch()
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: started.append(a))
    for args, message in [
            (["--model", str(tmp_path / "bad.json")], "transformers cannot read this configuration"),
            (["--model", llama, "--tp", "4", "--nproc", "4"],
             "tp=4 does not divide the 2 key/value heads (num_key_value_heads)"),
            (["--model", "qwen2-tiny", "--pp", "8", "--nproc", "8"],
             "8 stages, but Qwen2ForCausalLM has only 4 layers")]:
        run = tmp_path / "run"
        assert main(["train", *args, "--run-dir", str(run), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err
        assert not started and not run.exists()   # no rank was started, nothing written
