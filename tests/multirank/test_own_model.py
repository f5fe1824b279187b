"""Your own model from the command line: a `module:callable` and a transformers GPT-2 config
train under ZeRO on two ranks to the numbers the Python API gives (mt.Trainer on the same model,
batches and learning rates), and `--nproc 1` to exactly them."""
from pathlib import Path

import pytest
import torch

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank.test_cli_train import meshtrain, metrics

ROOT = Path(__file__).parents[2]
STEPS, BATCH, SEQ = 3, 8, 32
RUN = ["--seq", str(SEQ), "--batch", str(BATCH), "--steps", str(STEPS), "--no-progress",
       "--eval-every", "100", "--ckpt-every", str(STEPS)]


def gpt2_config(folder: Path) -> str:
    from transformers import GPT2Config

    path = folder / "gpt2.json"
    # no dropout: its masks come from each rank's own RNG, so no plan could equal one process
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=SEQ, resid_pdrop=0,
               embd_pdrop=0, attn_pdrop=0).to_json_file(path)
    return str(path)


def python_api(spec: str) -> dict:
    """What a user writes: the model, mt.Trainer, the run's batches and learning rates."""
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import BatchSampler
    from meshtrain.models.registry import build_model, token_cross_entropy
    from meshtrain.train.config import RunConfig, learning_rate

    config = RunConfig(run_dir="unused", steps=STEPS, batch_size=BATCH)
    torch.manual_seed(config.seed)
    model = build_model(spec, {}, SEQ).module
    trainer = mt.Trainer(model, mt.Plan(), loss_fn=token_cross_entropy,
                         optimizer=lambda ps: torch.optim.AdamW(
                             ps, lr=config.lr, weight_decay=config.weight_decay))
    sampler = BatchSampler(load_corpus(None).train, BATCH, SEQ, config.seed, 0, 1)
    losses = []
    for step in range(STEPS):
        for group in trainer.optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        losses.append(trainer.step(*sampler.batch(step)))
    return {"losses": losses, "state": trainer.full_state_dict()}


def cli_run(spec: str, folder: Path, *plan: str) -> dict:
    run = folder / "-".join(["run", *plan]).replace("--", "")
    out = meshtrain("train", "--model", spec, "--run-dir", str(run), *RUN, *plan, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    from meshtrain.models.registry import build_model
    from meshtrain.train import checkpoint
    from meshtrain.train.config import latest_checkpoint
    from meshtrain.core.state import StateLayout

    layout = StateLayout.of(build_model(spec, {}, SEQ).module)
    state, _, _ = checkpoint.load(latest_checkpoint(run), layout)
    return {"losses": [m["loss"] for m in metrics(run) if "loss" in m], "state": state}


@pytest.mark.parametrize("kind", ["callable", "transformers"])
def test_own_model_trains_from_the_command_line_to_the_python_apis_numbers(kind, tmp_path):
    if kind == "transformers":
        pytest.importorskip("transformers", reason="needs pip install -e '.[hf]'")
        spec = gpt2_config(tmp_path)
    else:
        spec = "tests.multirank.own_model:build"
    api = run_ranks(1, python_api, spec)[0]
    alone = cli_run(spec, tmp_path, "--nproc", "1")
    torch.testing.assert_close(torch.tensor(alone["losses"]), torch.tensor(api["losses"]),
                               rtol=0, atol=0)
    assert sorted(alone["state"]) == sorted(api["state"])
    for name, value in api["state"].items():
        torch.testing.assert_close(alone["state"][name], value, rtol=0, atol=0, msg=name)
    # sharded over two ranks (DDP's own path is the zero plans' gradient sync, and the
    # command's plain DDP is test_cli_train's)
    for plan in (["--nproc", "2", "--zero", "2" if kind == "callable" else "1"],):
        result = cli_run(spec, tmp_path, *plan)
        # AdamW's steps here are at most lr * 3/30 = 3e-4: every parameter within 1e-5 of one
        # process, the losses too (torch's own DDP: see test_ddp.py)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(api["losses"]),
                                   rtol=0, atol=1e-5, msg=lambda m: f"{plan} losses: {m}")
        for name, value in api["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5,
                                       msg=lambda m: f"{plan} {name}: {m}")
