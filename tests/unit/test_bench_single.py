"""`meshtrain bench single`: its arithmetic from given step times, and the command itself on
a tiny model (aot_eager: the compiled contenders traced without inductor's code generation)."""
import pytest

from meshtrain.bench import single
from meshtrain.cli.main import main


def test_ratios_tokens_and_mfu_from_given_times():
    times = {single.TORCH_EAGER: [0.30, 0.20, 0.25], single.TORCH_COMPILED: [0.10, 0.125, 0.9],
             single.OURS_EAGER: [0.25, 0.26, 0.24, 0.40], single.OURS_COMPILED: [0.2]}
    rows = single.summarise(times, tokens_per_step=1000, flops_per_tok=6e6, peak_flops=1e11)
    eager, compiled = rows[single.TORCH_EAGER], rows[single.TORCH_COMPILED]
    assert eager["step_s"] == 0.25 and eager["tokens_per_s"] == pytest.approx(4000)
    assert eager["mfu"] == pytest.approx(4000 * 6e6 / 1e11) and eager["vs_torch_eager"] == 1
    assert compiled["step_s"] == 0.125 and compiled["vs_torch_eager"] == pytest.approx(2.0)
    assert rows[single.OURS_EAGER]["step_s"] == pytest.approx(0.255)   # median of an even count
    assert rows[single.OURS_EAGER]["vs_torch_eager"] == pytest.approx(0.25 / 0.255)
    assert single.compile_speedup(rows) == pytest.approx({"torch": 2.0,
                                                          "meshtrain": 0.255 / 0.2})
    rows[single.OURS_CUDA_GRAPHS] = {"step_s": 0.17}   # the GPU's fifth contender
    assert single.compile_speedup(rows)[single.OURS_CUDA_GRAPHS] == pytest.approx(1.5)


def test_tokens_and_mfu_come_from_the_benches_one_helper(monkeypatch):
    """summarise's tokens/s and MFU are bench/device.py's `throughput` over one device (the
    arithmetic every bench shares), called with the median step."""
    calls = []

    def helper(step_s, tokens_per_step, basis, devices):
        calls.append((step_s, tokens_per_step, basis["flops_per_token"], basis["peak_flops"],
                      devices))
        return {"tokens_per_s": 7.0, "mfu": 0.125}
    monkeypatch.setattr(single, "throughput", helper)
    rows = single.summarise({single.TORCH_EAGER: [0.5, 0.3, 0.4]}, tokens_per_step=1000,
                            flops_per_tok=6e6, peak_flops=1e11)
    assert calls == [(0.4, 1000, 6e6, 1e11, 1)]
    assert rows[single.TORCH_EAGER] == {"step_s": 0.4, "tokens_per_s": 7.0, "mfu": 0.125,
                                        "vs_torch_eager": 1.0}


def test_default_model_follows_the_device():
    assert single.default_model("cuda") == "gpt2-124m" and single.default_model("cpu") == "tiny"


def test_the_command_runs_the_four_contenders(tmp_path, capsys):
    out = tmp_path / "single.json"
    code = main(["bench", "single", "--device", "cpu", "--model", "tiny", "--batch", "2",
                 "--steps", "1", "--reps", "2", "--warmup", "1", "--compile-backend",
                 "aot_eager", "--json", str(out)])
    report = capsys.readouterr().out
    assert code == 0
    for name in single.CONTENDERS:
        assert name in report
    import json
    result = json.loads(out.read_text())
    rows = result["contenders"]
    assert set(rows) == set(single.CONTENDERS) and result["device"] == "cpu"
    assert rows[single.TORCH_EAGER]["vs_torch_eager"] == 1.0
    assert result["peak_source"].startswith("measured:")
    losses = [row["last_loss"] for row in rows.values()]   # the same work: 3 steps each
    assert max(losses) - min(losses) < 1e-5, losses
