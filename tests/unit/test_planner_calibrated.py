"""The planner calibrated per device kind: device names map to the table's kinds, and a
profile of a kind changes `meshtrain plan --gpu KIND` by what it measured (planner.calibrated);
without one the table's figures stand."""
import json
import math

import pytest

from meshtrain.planner import Setup, preset
from meshtrain.planner.calibrated import (attention_flops, calibrated_cluster, gemm_flops,
                                          model_efficiency)
from meshtrain.planner.flops import elementwise_bytes_per_token, forward_flops_per_token
from meshtrain.planner.hardware import GPUS, Curve, HardwareError, device_kind, make_cluster
from meshtrain.planner.profile import DEFAULT_PATH, kind_path, load_profile, profile_path


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),          # SXM5, the table's figures
    ("NVIDIA H100 PCIe", "h100-pcie"),               # 756 TFLOPS: another kind
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "H200-141GB"),
    ("NVIDIA H200 NVL", "h200-nvl"),                 # the PCIe card: another peak
    ("NVIDIA L4", "L4-24GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),          # the same chip's peak and memory speed
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),      # not in the table
    ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),      # 112 TFLOPS: another kind
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
])
def test_device_names_map_to_the_tables_kinds(name, kind):
    assert device_kind(name) == kind
    assert (kind in GPUS) == kind[0].isupper()


@pytest.mark.parametrize("gpu, precision, peak", [
    ("H100-80GB", "bf16", 989e12), ("H100-80GB", "fp32", 67e12), ("A100-80GB", "bf16", 312e12),
    ("V100-32GB", "bf16", 15.7e12),   # no bf16 tensor cores: its fp32 rate, not fp16's 125
    ("V100-32GB", "fp32", 15.7e12)])
def test_a_presets_peak_is_the_data_sheets_at_the_precision(gpu, precision, peak):
    assert make_cluster(gpu, precision=precision).peak_flops == peak


def test_cpu_ranks_are_a_kind_by_core_count():
    assert device_kind(None, 2) == "cpu-2"


SPEC = preset("gpt2-1.3b")   # seq 2048, hidden 2048, ffn 8192, 16 heads
FLAT = {"gemm": {"shapes": [[8192, 1024, 4096], [8192, 8192, 32768]],
                 "flops_per_call": [gemm_flops(8192, 1024, 4096), gemm_flops(8192, 8192, 32768)],
                 "efficiency": [0.25, 0.25]},
        "attention": {"shapes": [[8, 16, 1024, 64]], "flops_per_call": [attention_flops(8, 16, 1024, 64)],
                      "efficiency": [0.25]}}


def _profile(entry: dict, worlds=("1",), kind="H100-80GB") -> dict:
    base = {"matmul_flops": 7e14, "model_flops": 1e13, "mem_bw": GPUS["H100-80GB"].mem_bw,
            "peak_flops": GPUS["H100-80GB"].peak_bf16,
            "optimizer_rate": 1e9, "collectives": {}, "launch_rate": 2e5, "ops_per_block": 50.0,
            **entry}
    return {"created": "2026-11-25T10:00:00", "cpu_count": 16, "host_mem": 1e12,
            "device": {"kind": kind, "type": "cuda", "dtype": "bf16", "count": 8},
            "worlds": {w: base for w in worlds}}


def test_the_models_efficiency_weighs_gemms_and_attention_by_their_flops():
    # GEMM efficiency 0.4 at 1e9 FLOPs, 0.8 at 1e13; attention 0.3 and 0.6 at 1e9 and 1e13
    entry = {"gemm": {"flops_per_call": [1e13, 1e9], "efficiency": [0.8, 0.4]},
             "attention": {"flops_per_call": [1e9, 1e13], "efficiency": [0.3, 0.6]}}
    s, h, f = SPEC.seq, SPEC.hidden, SPEC.ffn_hidden
    # the model's largest GEMM of one sequence, and one sequence's attention, log-linear
    e_gemm = 0.4 + 0.4 * math.log(2 * s * h * f / 1e9) / math.log(1e4)
    e_attn = 0.3 + 0.3 * math.log(12 * s * s * h / 1e9) / math.log(1e4)
    layer, scores, logits = forward_flops_per_token(SPEC, s)
    f_attn, f_gemm = SPEC.layers * scores, SPEC.layers * (layer - scores) + logits
    expected = (f_gemm + f_attn) / (f_gemm / e_gemm + f_attn / e_attn)
    assert model_efficiency(entry, SPEC) == pytest.approx(expected)
    assert 0.4 < e_attn < e_gemm < 0.8   # really between the points, not at an end
    # held at the ends; never above 1; none without GEMMs measured
    assert model_efficiency({"gemm": {"flops_per_call": [1e15], "efficiency": [0.7]}}, SPEC) == 0.7
    assert model_efficiency({"gemm": {"flops_per_call": [1.0], "efficiency": [1.3]}}, SPEC) == 1.0
    assert model_efficiency({}, SPEC) is None


def _cli(capsys, monkeypatch, home, *argv):
    from meshtrain.cli.main import main
    monkeypatch.setenv("HOME", str(home))
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


ARGV = ("--model", "gpt2-1.3b", "--gpu", "H100-80GB", "--gpus-per-node", "1",
        "--global-batch", "8", "--micro-batch", "4", "--recompute", "none")


def test_a_profile_of_the_named_gpu_changes_the_step_by_what_it_measured(capsys, monkeypatch,
                                                                         tmp_path):
    """One GPU, no communication: the step is 2 micro-batches of compute and the optimizer
    step. The profile measured efficiency 0.25 (the table's default: 0.5) and 50 ops per
    block at 200k launches/s; its memory bandwidth is the table's."""
    table = json.loads(_cli(capsys, monkeypatch, tmp_path, *ARGV, "--json"))
    assert table["cluster"]["calibration"] is None and table["cluster"]["efficiency"] == 0.5
    path = kind_path("H100-80GB")
    assert str(path).startswith(str(tmp_path))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_profile(FLAT)))
    calibrated = json.loads(_cli(capsys, monkeypatch, tmp_path, *ARGV, "--json"))
    cl = calibrated["cluster"]
    assert cl["efficiency"] == pytest.approx(0.25) and cl["block_overhead"] == pytest.approx(50 / 2e5)
    assert cl["calibration"]["created"] == "2026-11-25T10:00:00"
    assert cl["calibration"]["calibrated"] == ["efficiency", "mem_bw", "block_overhead"]
    assert "peak_flops" in cl["calibration"]["table"] and "intra_bw" in cl["calibration"]["table"]
    before, after = table["plans"][0], calibrated["plans"][0]
    assert before["plan"] == after["plan"] and before["micro_batch"] == after["micro_batch"] == 4
    # per micro-batch: the slower of the host's dispatch, overhead x (layers + 1), and the
    # device's work, F / (peak e) with e measured on GEMMs and attention, and the elementwise
    # work at the memory's speed beside it: the device's here
    layer, _, logits = forward_flops_per_token(SPEC, SPEC.seq)
    flops = 4 * SPEC.seq * (SPEC.layers * 3 * layer + 3 * logits)
    peak = GPUS["H100-80GB"].peak_bf16
    t_table = flops / (peak * 0.5)
    elementwise = 4 * SPEC.seq * elementwise_bytes_per_token(SPEC, SPEC.layers) / GPUS[
        "H100-80GB"].mem_bw
    t_calibrated = max(flops / (peak * 0.25) + elementwise, 50 / 2e5 * (SPEC.layers + 1))
    assert t_calibrated == flops / (peak * 0.25) + elementwise
    assert before["time"]["compute"] == pytest.approx(2 * t_table)
    assert after["time"]["compute"] == pytest.approx(2 * t_calibrated)
    assert after["time"]["total"] - before["time"]["total"] == pytest.approx(
        2 * (t_calibrated - t_table))
    words = _cli(capsys, monkeypatch, tmp_path, *ARGV)
    assert f"Calibrated on H100-80GB ({path}, 2026-11-25T10:00:00, bf16)" in words


def test_figures_the_user_gives_and_other_precisions_keep_theirs(capsys, monkeypatch, tmp_path):
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(_profile(FLAT)))
    given = json.loads(_cli(capsys, monkeypatch, tmp_path, *ARGV, "--profile", str(path),
                            "--efficiency", "0.6", "--json"))["cluster"]
    assert given["efficiency"] == 0.6 and given["calibration"]["given"] == ["efficiency"]
    # a peak the user gives: the same measured FLOP/s are twice its half of the table's
    half = json.loads(_cli(capsys, monkeypatch, tmp_path, *ARGV, "--profile", str(path),
                           "--peak-flops", "494.5TFLOPS", "--json"))["cluster"]
    assert half["efficiency"] == pytest.approx(0.5) and "peak_flops" in half["calibration"]["table"]
    fp32 = json.loads(_cli(capsys, monkeypatch, tmp_path, *ARGV, "--profile", str(path),
                           "--precision", "fp32", "--micro-batch", "1", "--json"))["cluster"]
    assert fp32["efficiency"] == 0.5 and "efficiency" in fp32["calibration"]["table"]


def test_the_hosts_own_runs_replace_the_launch_count_where_measured():
    """A profile whose calibration timed the host apart (fit.fit_host) gives a GPU of its
    kind that host: per block and micro-batch, per layer, per step, a recomputed block's."""
    host = {"per_step": 0.006, "per_layer": 0.0002, "per_block": 0.0015, "recompute_blocks": 2.5}
    cl = calibrated_cluster(make_cluster("H100-80GB"), _profile({**FLAT, "host": host}), SPEC,
                            "bf16", "p.json")
    assert cl.async_dispatch and (cl.block_overhead, cl.layer_step_overhead, cl.step_overhead,
                                  cl.recompute_dispatch) == (0.0015, 0.0002, 0.006, 2.5)
    older = calibrated_cluster(make_cluster("H100-80GB"), _profile(FLAT), SPEC, "bf16", "p.json")
    assert older.block_overhead == pytest.approx(50 / 2e5) and older.step_overhead == 0
    assert (older.layer_step_overhead, older.recompute_dispatch) == (0.0, 4 / 3)


def test_a_profile_of_another_kind_is_refused():
    with pytest.raises(HardwareError, match="measured on 'A100-80GB', not 'H100-80GB'"):
        calibrated_cluster(make_cluster("H100-80GB"), _profile(FLAT, kind="A100-80GB"), SPEC,
                           "bf16", "p.json")
    older = {k: v for k, v in _profile(FLAT).items() if k != "device"}
    with pytest.raises(HardwareError, match="names no device kind"):
        calibrated_cluster(make_cluster("H100-80GB"), older, SPEC, "bf16", "p.json")


def test_curves_measured_in_a_node_price_only_groups_inside_it():
    curve = {"sizes": [256, 2**24], "busbw": [1e9, 4e11]}
    entry = {**FLAT, "collectives": {k: curve for k in ("all_reduce", "all_gather")}}
    cl = calibrated_cluster(make_cluster("H100-80GB", nodes=2), _profile(entry, ("1", "8")),
                            SPEC, "bf16", "p.json")
    assert cl.calibration["calibrated"][-1] == "collectives at 8 ranks"
    size = 2**24
    inside = cl.collective_time("all_reduce", size, 8, 8)
    assert inside == pytest.approx(2 * 7 / 8 * size / 4e11)
    across = cl.collective_time("all_reduce", size, 16, 16)
    assert across == pytest.approx(2 * 15 * cl.inter_latency + 2 * 15 / 16 * size / cl.inter_bw)
    assert not cl.curves_replace_links


def test_the_local_kind_finds_its_profile_or_an_older_single_one(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    legacy = DEFAULT_PATH.expanduser()
    with pytest.raises(HardwareError, match=r"run `meshtrain plan --calibrate` first on this device \(cpu-2\)"):
        load_profile(None, "cpu-2")
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps({"created": "old", "worlds": {}}))   # before kinds
    assert profile_path(None, "cpu-2") == legacy and load_profile(None, "cpu-2")["created"] == "old"
    own = kind_path("cpu-2")
    own.parent.mkdir(parents=True)
    own.write_text(json.dumps({"created": "new", "device": {"kind": "cpu-2"}, "worlds": {}}))
    assert load_profile(None, "cpu-2")["created"] == "new"
    # an older profile naming another kind never stands in for this one
    legacy.write_text(json.dumps({"device": {"kind": "H100-80GB"}, "worlds": {}}))
    assert profile_path(None, "cpu-4") == kind_path("cpu-4")
