"""What a run folder says about its run, read back for pictures and summaries.

A run folder (see train/run.py) holds `config.json` (with the MFU peak, written at the start),
`metrics.jsonl` (one record per step and per evaluation) and, once the run ended,
`summary.json` (memory per rank among others).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class NotARun(ValueError):
    """A folder that is not a meshtrain run folder, or an unreadable one."""


@dataclass
class RunData:
    path: Path
    label: str                                   # the plan, or the folder's name
    steps: list[int] = field(default_factory=list)          # per training step
    loss: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)          # runs before MFU was logged: empty
    bytes_by_axis: dict[str, list[int]] = field(default_factory=dict)   # axis -> per step
    eval_steps: list[int] = field(default_factory=list)     # per evaluation
    val_loss: list[float] = field(default_factory=list)
    memory_per_rank: list[dict] = field(default_factory=list)   # from summary.json, if ended
    summary: dict = field(default_factory=dict)
    peak_flops: float | None = None   # MFU's peak per device (config.json: known from the start)
    peak_source: str | None = None


def read_run(path) -> RunData:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir() or not (path / "config.json").exists() or not metrics.exists():
        raise NotARun(f"{path} is not a meshtrain run folder (it needs config.json and "
                      "metrics.jsonl); give a folder `meshtrain train` made")
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        summary_file = path / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        config = json.loads((path / "config.json").read_text())
        plan = config.get("plan", {})
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotARun(f"{path}: a file of the run folder is not valid JSON ({exc})") from None
    run = RunData(path, summary.get("plan") or _describe(plan) or path.name, summary=summary,
                  memory_per_rank=summary.get("memory_per_rank", []),
                  peak_flops=summary.get("peak_flops") or config.get("peak_flops"),
                  peak_source=summary.get("peak_source") or config.get("peak_source"))
    steps_seen = [r for r in records if "loss" in r]
    axes = sorted({a for r in steps_seen for a in r.get("bytes_by_axis", {})})
    run.bytes_by_axis = {a: [] for a in axes}
    for r in steps_seen:
        run.steps.append(r["step"])
        run.loss.append(r["loss"])
        run.tokens_per_s.append(r["tokens_per_s"])
        if "mfu" in r:
            run.mfu.append(r["mfu"])
        for a in axes:
            run.bytes_by_axis[a].append(r.get("bytes_by_axis", {}).get(a, 0))
    for r in records:
        if "val_loss" in r:
            run.eval_steps.append(r["step"])
            run.val_loss.append(r["val_loss"])
    if not run.steps and not run.eval_steps:
        raise NotARun(f"{path} holds no training step yet (metrics.jsonl is empty)")
    return run


def _describe(plan: dict) -> str:
    from meshtrain.core.plan import Plan
    try:
        return Plan.from_dict(plan).describe()
    except ValueError:
        return ""
