"""`meshtrain bench slowlink` on 2 ranks, a few steps: its table's figures are the runs' own
counters (summary.json), DiLoCo sends fewer bytes than DDP, the comparison at a common loss
and both crossovers are filled in, and the picture is written."""
import json

from meshtrain.bench import slowlink


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
    text = slowlink.format_report(result)
    for column in ("step ms (median)", "bytes/step", "val loss", "common loss",
                   "s to it (method / DDP)", "crossover measured", "crossover planner",
                   "EMULATED LINK"):
        assert column in text
    assert (tmp_path / "slowlink.png").stat().st_size > 0
