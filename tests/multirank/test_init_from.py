"""--init-from / from_pretrained: a transformers model folder (one safetensors file, or
shards with their index) loaded slice by slice under every plan gives exactly the weights
from_pretrained gives in one process, and the same loss on a batch; each rank reads only
the tensors it keeps. Bad folders are refused before anything is read, naming file and
tensor."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import meshtrain as mt  # noqa: E402
from meshtrain.models import hf_presets  # noqa: E402
from meshtrain.models.deferred import source_of  # noqa: E402
from meshtrain.models.pretrained import PretrainedError, SafetensorsFolder, from_pretrained  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402

PLANS = [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2), dict(dp=2, zero=3)]


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(5)
    model = hf_presets.build("llama-tiny-tied")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    return root


def loaded(folder: str, plans: list[dict]) -> list[tuple]:
    """Per plan: (the consolidated state, the loss on one batch, the names this rank read)."""
    out = []
    for plan in plans:
        model = from_pretrained(folder)
        source = source_of(model)
        read: list[str] = []
        tensors = source.folder.tensors

        def counting(device="cpu", wanted=None):
            for name, value in tensors(device, wanted):
                read.append(name)
                yield name, value
        source.folder.tensors = counting
        trainer = mt.Trainer(model, mt.Plan(**plan),
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        x, y = _batch()
        loss = trainer.evaluate([(x, y)])
        kept = {n for n, _ in trainer.stages.named_parameters()}
        out.append(({k: v.clone() for k, v in trainer.full_state_dict().items()}, loss,
                    sorted(read), sorted(kept)))
        trainer.close()
    return out


def _one_process(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    x, y = _batch()
    logits = model(x, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return model.state_dict(), loss.item()


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_every_plan_loads_what_from_pretrained_loads(folders, kind):
    folder = str(folders / kind)
    if kind == "sharded":
        assert (folders / kind / "model.safetensors.index.json").is_file()
    state, loss = _one_process(folder)
    for (got, got_loss, read, kept), plan in zip(run_ranks(2, loaded, folder, PLANS)[0], PLANS):
        for name, value in state.items():
            assert torch.equal(got[name], value), f"{plan}: {name}"
        assert abs(got_loss - loss) <= 1e-5, (plan, got_loss, loss)
        # a pipeline stage reads only its own tensors (a tied embedding: both ends hold it)
        assert set(read) <= set(kept), (plan, sorted(set(read) - set(kept)))


def test_three_axes_load_what_from_pretrained_loads(folders):
    folder = str(folders / "sharded")
    state, loss = _one_process(folder)
    plans = [dict(dp=2, tp=2, pp=2, microbatches=2)]
    (got, got_loss, read, kept), = run_ranks(8, loaded, folder, plans)[0]
    assert all(torch.equal(got[n], v) for n, v in state.items())
    assert abs(got_loss - loss) <= 1e-5


def test_bad_folders_are_refused_naming_file_and_tensor(folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    good = folders / "single"
    # another model's config: shapes differ
    other = tmp_path / "other"
    shutil.copytree(good, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] = 32
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match="model.embed_tokens.weight has shape"):
        from_pretrained(other)
    # truncated file
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(PretrainedError, match="model.safetensors cannot be read"):
        SafetensorsFolder(cut)
    # a tensor of the wrong kind
    wrong = tmp_path / "wrong"
    shutil.copytree(good, wrong)
    tensors = load_file(str(wrong / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match="model.norm.weight is I32"):
        from_pretrained(wrong)
    # a missing tensor
    tensors = load_file(str(good / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match="model.layers.1.mlp.up_proj.weight"):
        from_pretrained(wrong)
    # an index naming a file that is not there
    broken = tmp_path / "broken"
    shutil.copytree(folders / "sharded", broken)
    shard = sorted(broken.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(PretrainedError, match=f"names {shard.name}"):
        SafetensorsFolder(broken)
    with pytest.raises(PretrainedError, match="needs the network"):
        SafetensorsFolder("meta-llama/Llama-3.2-1B")


def test_the_command_refuses_a_folder_that_does_not_fit_before_any_rank_starts(
        folders, tmp_path, monkeypatch, capsys):
    import importlib
    import shutil

    from meshtrain.cli.main import main

    other = tmp_path / "other"
    shutil.copytree(folders / "single", other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    started = []
    launcher = importlib.import_module("meshtrain.launch")
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: started.append(a))
    for args, message in [
            (["--init-from", str(other)], "has shape [64, 128], the model's is [64, 96]"),
            # --model given: its config is another model's than the folder's weights
            (["--init-from", str(folders / "single"), "--model", "qwen2-tiny"],
             "holds no value for 7 tensor(s) of the model: lm_head.weight"),
            (["--init-from", str(tmp_path / "nowhere")], "no such folder")]:
        run = tmp_path / "run"
        assert main(["train", *args, "--run-dir", str(run), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err
        assert not started and not run.exists()


def test_a_mixture_saved_one_tensor_per_expert_loads_as_from_pretrained_loads(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(5)
    hf_presets.build("mixtral-tiny").save_pretrained(tmp_path / "moe")
    folder = str(tmp_path / "moe")
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:   # the Hub's layout
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in f.keys()
    state, _ = _one_process(folder)
    plans = [dict(dp=2, ep=2), dict(pp=2, microbatches=2)]
    for (got, _, read, kept), plan in zip(run_ranks(2, loaded, folder, plans)[0], plans):
        for name, value in state.items():
            assert torch.equal(got[name], value), f"{plan}: {name}"
        assert set(read) <= set(kept), (plan, sorted(set(read) - set(kept)))
