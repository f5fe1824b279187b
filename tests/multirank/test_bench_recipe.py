"""`meshtrain bench recipe` at its tiny size on the CPU, one step a repetition: both sides
train the same Llama on the same tokens, and the report's figures are the measured times'
arithmetic (tokens/s = the step's tokens / the median step, MFU = FLOPs per token from
core/flops.py x tokens/s / the stated peak), not a speed."""
import json
import statistics

import pytest

from meshtrain.bench import recipe
from meshtrain.cli.main import main
from meshtrain.core.flops import flops_per_token

pytest.importorskip("transformers")


def test_the_command_runs_both_sides_and_its_arithmetic_holds(tmp_path, capsys):
    out = tmp_path / "recipe.json"
    code = main(["bench", "recipe", "--device", "cpu", "--batch", "2", "--seq", "32",
                 "--steps", "1", "--reps", "2", "--warmup", "1", "--compile-backend", "none",
                 "--json", str(out)])
    assert code == 0 and "meshtrain / recipe" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["tokens_per_step"] == 2 * 32 and result["size"] == "tiny"
    config = recipe.llama_config("tiny", 32)
    model = recipe._build(config, "meta")
    n = sum(p.numel() for p in model.parameters())   # the tied embedding counted once
    assert result["flops_per_token"] == flops_per_token(n, config.num_hidden_layers,
                                                        config.hidden_size, 32)
    assert result["peak_source"].startswith("measured:")
    for name, row in result["sides"].items():
        times = result["all_times"][name]
        assert len(times) == 2   # reps x steps, timed
        assert row["step_s"] == statistics.median(times)
        assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
        assert row["mfu"] == pytest.approx(64 * result["flops_per_token"]
                                           / (row["step_s"] * result["peak_flops"]))
        assert row["peak_bytes"] is None   # no device allocator on the CPU
    ours, theirs = result["sides"][recipe.OURS], result["sides"][recipe.RECIPE]
    assert result["ratios"]["tokens_per_s"] == pytest.approx(
        ours["tokens_per_s"] / theirs["tokens_per_s"])
    # the same work: the same model, tokens and number of AdamW steps (4) in fp32
    assert ours["last_loss"] == pytest.approx(theirs["last_loss"], abs=1e-5)
