"""`meshtrain generate` and `meshtrain train --tensorboard` on a real run trained under ZeRO-2:
the model generate loads reproduces the run's own final validation loss in one process, the
text it prints is the model's continuation, TensorBoard's events hold metrics.jsonl's
numbers; bad input is refused in one line."""
import json
from pathlib import Path

import pytest
import torch

from meshtrain.cli.main import main
from meshtrain.train.config import RunConfig
from tests.multirank.test_cli_train import SMALL, meshtrain, metrics

try:   # only the events test needs it: the run is written with or without its events
    import tensorboard  # noqa: F401
    TENSORBOARD = True
except ImportError:
    TENSORBOARD = False


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("generate") / "run"
    events = ["--tensorboard"] if TENSORBOARD else []
    out = meshtrain("train", "--nproc", "2", "--zero", "2", "--steps", "6", *events,
                    "--run-dir", str(run), *SMALL)
    assert out.returncode == 0, out.stderr
    return run


def test_the_loaded_model_gives_the_runs_final_validation_loss(run_dir):
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import eval_batches
    from meshtrain.train.generate import load_trained

    model, seq_len, steps = load_trained(run_dir)
    config = RunConfig.load(run_dir)
    val = eval_batches(load_corpus(config.data).val, max(1, config.batch_size // 2), seq_len,
                       config.eval_batches)
    with torch.no_grad():
        loss = sum(float(model.loss(model(x), y)) for x, y in val) / len(val)
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    assert steps == 6 and seq_len == 32
    assert loss == pytest.approx(summary["val_loss_end"], abs=1e-5)


def test_generate_prints_the_models_continuation(run_dir, capsys):
    from meshtrain.train.generate import generate, load_trained

    model, seq_len, _ = load_trained(run_dir)
    greedy = generate(model, "def ", 30, seq_len, temperature=0)
    # greedy by hand: each byte the argmax after the bytes before it
    context = list(b"def ")
    for _ in range(30):
        with torch.no_grad():
            context.append(int(model(torch.tensor([context[-seq_len:]]))[0, -1].argmax()))
    assert greedy == bytes(context[4:])
    assert main(["generate", str(run_dir), "--tokens", "30", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def " + greedy.decode("utf-8", errors="replace") + "\n"
    # sampling: reproducible from the seed, top-k 1 is greedy
    a = generate(model, "def ", 30, seq_len, temperature=1.0, top_k=None, seed=3)
    assert a == generate(model, "def ", 30, seq_len, temperature=1.0, top_k=None, seed=3)
    assert a != generate(model, "def ", 30, seq_len, temperature=1.0, top_k=None, seed=4)
    assert generate(model, "def ", 30, seq_len, temperature=1.0, top_k=1) == greedy


@pytest.mark.skipif(not TENSORBOARD, reason="needs pip install -e '.[tb]'")
def test_tensorboard_events_hold_the_runs_metrics(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [m for m in metrics(run_dir) if "loss" in m]
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged == pytest.approx({m["step"]: m["loss"] for m in steps}, rel=1e-6)
    sent = {e.step: e.value for e in events.Scalars("bytes_sent/dp")}
    assert sent == {m["step"]: m["bytes_by_axis"]["dp"] for m in steps}
    assert [e.step for e in events.Scalars("val_loss")] == [0, 3, 6]
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    for rank in (0, 1):
        [optimizer] = events.Scalars(f"memory/rank{rank}/optimizer_states")
        assert optimizer.value == summary["memory_per_rank"][rank]["optimizer_states"]


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens 0"),
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
])
def test_bad_sampling_is_refused(run_dir, args, message, capsys):
    assert main(["generate", str(run_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_is_not_a_run_or_has_no_checkpoint_is_refused(tmp_path, capsys):
    assert main(["generate", str(tmp_path)]) == 2
    assert "is not a meshtrain run folder" in capsys.readouterr().err
    RunConfig(run_dir=str(tmp_path)).save()
    assert main(["generate", str(tmp_path)]) == 2
    assert "has no checkpoint yet" in capsys.readouterr().err


# ---- meshtrain export -----------------------------------------------------------------------
def test_export_writes_the_checkpoints_weights_as_safetensors(run_dir, tmp_path):
    from safetensors.torch import load_file

    from meshtrain.models.registry import build_model
    from meshtrain.train import checkpoint
    from meshtrain.train.config import latest_checkpoint
    from meshtrain.core.state import StateLayout

    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), str(out)]) == 0
    config = RunConfig.load(run_dir)
    model = build_model(config.model, config.model_overrides, config.seq_len).module
    saved, _, _ = checkpoint.load(latest_checkpoint(run_dir), StateLayout.of(model))
    model.load_state_dict(load_file(str(out)))    # every key, strict
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_export_refuses_bad_targets(run_dir, tmp_path, capsys):
    (tmp_path / "there.safetensors").write_bytes(b"keep me")
    cases = [(tmp_path / "there.safetensors", "exists; pass --force"),
             (tmp_path / "model.pt", "ending in .safetensors"),
             (tmp_path / "no" / "m.safetensors", "is not a folder")]
    for out, message in cases:
        assert main(["export", str(run_dir), str(out)]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "there.safetensors").read_bytes() == b"keep me"
    assert main(["export", str(tmp_path), str(tmp_path / "m.safetensors")]) == 2
    assert "is not a meshtrain run folder" in capsys.readouterr().err
