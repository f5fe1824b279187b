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
    plans = {"tp": ["--tp", "2", "--zero", "3", "--nproc", "4"],   # ZeRO-3 x tp: dp 2, tp 2
             "pp": ["--pp", "2", "--microbatches", "2"]}
    for name, plan in plans.items():
        run = tmp_path / name
        out = meshtrain("train", "--model", spec, "--run-dir", str(run), *RUN, *plan, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        losses[name] = [m["loss"] for m in metrics(run) if "loss" in m]
    assert len(losses["tp"]) == 3
    # the same seed, batches and model: both plans are the one-process run, within fp32
    torch.testing.assert_close(torch.tensor(losses["tp"]), torch.tensor(losses["pp"]),
                               rtol=0, atol=1e-5)
    folder = tmp_path / "exported"   # written tensor by tensor, never the whole model
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
    # and back in: a run starting from the exported folder starts where the run ended
    again = tmp_path / "again"
    out = meshtrain("train", "--init-from", str(folder), "--run-dir", str(again), *RUN,
                    "--tp", "2", "--steps", "1", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    end = [m["val_loss"] for m in metrics(tmp_path / "tp") if "val_loss" in m][-1]
    start = [m["val_loss"] for m in metrics(again) if "val_loss" in m][0]
    assert abs(start - end) <= 1e-5, (start, end)


def test_export_in_shards_loads_to_the_same_logits(tmp_path):
    """Shards no larger than the largest tensor, with their index, written one group at a
    time from the checkpoint: transformers loads the folder to the trainer's logits."""
    import json
    import math

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from meshtrain.cli import export_cmd
    from meshtrain.models.hf_presets import config_of
    from meshtrain.train.generate import load_trained

    config_of("llama-tiny-tied").save_pretrained(tmp_path / "llama")
    run = tmp_path / "run"
    out = meshtrain("train", "--model", str(tmp_path / "llama" / "config.json"), "--run-dir",
                    str(run), *RUN, "--steps", "2", "--ckpt-every", "2", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    folder, count, _ = export_cmd.export(run, tmp_path / "exported", shard_bytes=1)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    largest = 256 * 64 * 4   # the (tied) embedding
    assert len(files) > 1 and count == len(index["weight_map"])
    for name in files:
        with safe_open(str(folder / name), "pt") as f:
            assert sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()) <= largest
    assert "lm_head.weight" not in index["weight_map"]   # tied: saved once, as save_pretrained
    trained, _, _ = load_trained(run)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)


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
             "8 stages, but Qwen2ForCausalLM has only 4 layers"),
            (["--model", "mixtral-tiny", "--tp", "2", "--sequence-parallel", "--nproc", "2"],
             "its experts stay whole over tp and would route each rank's slice"),
            (["--model", "qwen3-moe-tiny", "--pp", "2", "--compile", "--nproc", "2"],
             "compiled mixture-of-experts layers are not built under pipeline stages")]:
        run = tmp_path / "run"
        assert main(["train", *args, "--run-dir", str(run), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err
        assert not started and not run.exists()   # no rank was started, nothing written
