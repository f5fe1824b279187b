"""`meshtrain bench slowlink` on 2 ranks, a few steps: its table's figures are the runs' own
counters (summary.json), DiLoCo sends fewer bytes than DDP, the comparison at a common loss
and both crossovers are filled in, the link time the planner prices per step is what the
emulated link slept, and the picture is written."""
import json

import pytest

from meshtrain.bench import slowlink
from meshtrain.bench import slowlink_crossover as xover
from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.time_model import step_time


def _planner_link_s(flags: list[str]) -> float:
    """Seconds the planner puts per step on the default emulated link (1 Gb/s, 5 ms), for a
    method's flags on 2 ranks of batch 4, arithmetic free."""
    setup = Setup(global_batch=4, micro_batch=2, precision="fp32", optimizer="adam",
                  recompute="none")
    free = Cluster(nodes=2, gpus_per_node=1, inter_bw=1.25e8, inter_latency=5e-3,
                   peak_flops=1e30, mem_bw=1e30, overlap=0.0)
    return step_time(preset("tiny"), Candidate(xover.plan_of(flags, 2), 2), setup, free).total


def test_bench_slowlink_table_matches_the_counters(tmp_path):
    methods = {"ddp": [], "diloco H=2": ["--dp-mode", "diloco", "--sync-every", "2"]}
    result = slowlink.run(str(tmp_path), nproc=2, steps=4, eval_every=2, batch=4,
                          methods=methods, progress=lambda m: None)
    rows = result["methods"]
    for name, run_dir in (("ddp", "ddp"), ("diloco H=2", "diloco_H2")):
        summary = json.loads((tmp_path / run_dir / "summary.json").read_text())
        assert rows[name]["bytes_per_step"] == summary["bytes_sent_per_step"]
        assert rows[name]["val_loss"] == summary["val_loss_end"]
        assert rows[name]["median_step_s"] == summary["median_step_s"]
        sent = [json.loads(x).get("bytes_sent") for x in
                (tmp_path / run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[name]["bytes_per_step"] == sum(b for b in sent if b is not None) / 4
    assert rows["diloco H=2"]["bytes_per_step"] < rows["ddp"]["bytes_per_step"] / 1.5
    dil, ddp = rows["diloco H=2"], rows["ddp"]
    assert dil["target_loss"] == max(dil["val_loss"], ddp["val_loss"])
    assert dil["speedup"] == dil["ddp_s_to_target"] / dil["s_to_target"]
    assert dil["crossover_Bps"] is not None and dil["planner_crossover_Bps"] is not None
    assert 0 < dil["steps_to_target"] <= 4 and 0 < dil["ddp_steps_to_target"] <= 4
    # what the link slept: DDP's every step, DiLoCo's per round of 2, as the planner prices
    # them (but a few bytes of statistics it counts approximately)
    records = lambda run_dir: [json.loads(x) for x in (
        tmp_path / run_dir / "metrics.jsonl").read_text().splitlines()]
    slept = lambda run_dir: [r["link_s"] for r in records(run_dir) if "step_s" in r]
    assert slept("ddp") == [pytest.approx(_planner_link_s([]), rel=1e-4)] * 4
    dil_s = _planner_link_s(methods["diloco H=2"])
    rounds = slept("diloco_H2")
    assert [rounds[0] + rounds[1], rounds[2] + rounds[3]] == [pytest.approx(2 * dil_s,
                                                                            rel=1e-4)] * 2
    text = slowlink.format_report(result)
    for column in ("step ms (median)", "bytes/step", "val loss", "common loss",
                   "steps to it (method / DDP)", "s to it (method / DDP)", "crossover measured",
                   "crossover planner", "EMULATED LINK"):
        assert column in text
    assert (tmp_path / "slowlink.png").stat().st_size > 0
