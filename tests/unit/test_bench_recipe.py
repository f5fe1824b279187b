"""`meshtrain bench recipe`: its arithmetic from given step times, and its refusals before
any rank starts. The run itself: tests/multirank/test_bench_recipe.py."""
import pytest

from meshtrain.bench import recipe
from meshtrain.cli.main import main


def _raw(times: dict, peaks: dict) -> dict:
    return {"size": "tiny", "batch": 2, "seq": 8, "precision": "fp32", "compile": None,
            "steps": 1, "reps": 3, "device": "cpu", "tokens_per_step": 16,
            "flops_per_token": 5e5, "peak_flops": 4e10, "peak_source": "given",
            "times": times, "peak_bytes": peaks,
            "last_loss": {recipe.OURS: 5.0, recipe.RECIPE: 5.0}}


def test_tokens_mfu_and_ratios_from_given_times():
    raw = _raw({recipe.RECIPE: [0.4, 0.1, 0.2], recipe.OURS: [0.1, 0.3, 0.05, 0.2]},
               {recipe.RECIPE: 3 * 2**30, recipe.OURS: 2**30})
    result = recipe.summarise(raw)
    ours, theirs = result["sides"][recipe.OURS], result["sides"][recipe.RECIPE]
    assert theirs["step_s"] == 0.2 and ours["step_s"] == pytest.approx(0.15)   # medians
    assert theirs["tokens_per_s"] == pytest.approx(16 / 0.2)
    assert ours["mfu"] == pytest.approx(16 / 0.15 * 5e5 / 4e10)
    assert result["ratios"]["tokens_per_s"] == pytest.approx(0.2 / 0.15)
    assert result["ratios"]["mfu"] == pytest.approx(0.2 / 0.15)
    assert result["ratios"]["peak_bytes"] == pytest.approx(1 / 3)
    report = recipe.format_report(result)
    assert "tokens/s 1.333x" in report and "peak memory 0.333x" in report


def test_no_memory_ratio_without_a_device_peak():
    result = recipe.summarise(_raw({recipe.RECIPE: [0.2], recipe.OURS: [0.2]},
                                   {recipe.RECIPE: None, recipe.OURS: None}))
    assert result["ratios"]["peak_bytes"] is None
    assert "n/a (CPU)" in recipe.format_report(result)


def test_the_llama_shapes():
    big = recipe.llama_config("1b", 4096)
    assert (big.hidden_size, big.num_hidden_layers, big.num_key_value_heads,
            big.vocab_size) == (2048, 16, 8, 128256)
    assert big.max_position_embeddings == 4096 and not big.use_cache


@pytest.mark.parametrize("argv, words", [
    ("bench recipe --model tiny", "--model tiny: the recipe bench runs a Llama"),
    ("bench recipe --seq 0", "--seq 0: give a sequence length >= 1"),
    ("bench single --precision fp8", "--precision fp8: the recipe bench only"),
    ("bench single --compile-backend none", "--compile-backend none: single races"),
])
def test_bad_input_is_refused_before_any_rank(argv, words, capsys):
    assert main(argv.split()) == 2
    assert words in capsys.readouterr().err


def test_fp8_names_what_is_missing(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert main("bench recipe --device cpu --precision fp8".split()) == 2
    assert "pip install 'meshtrain[fp8]'" in capsys.readouterr().err
