"""DDP against DiLoCo, local SGD and PowerSGD over an emulated slow dp link (`meshtrain bench slowlink`).

Each method is one `meshtrain train` run (same model, data, seed, steps and global batch, so
the same tokens) with `--link`; the figures come from its metrics.jsonl: the median step
time, the bytes each step sent (the accounted counters), the validation loss at equal tokens
and the training seconds (sum of step times, evaluations excluded) to reach DDP's final
validation loss. Every figure is EMULATED: the link sleeps its modelled time (core/link.py).

Measured crossover against DDP, from one bandwidth: a step's emulated link time is
latency terms + bytes/bandwidth, so each method's step is c + b/B with b its bytes per step
and c the rest (measured step minus b/B); DDP and the method take equal time at
B* = (b_ddp - b) / (c - c_ddp).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from meshtrain.core.link import parse_link_spec

METHODS = {"ddp": [], "diloco H=8": ["--dp-mode", "diloco", "--sync-every", "8"],
           "diloco H=32": ["--dp-mode", "diloco", "--sync-every", "32"],
           "local-sgd H=8": ["--dp-mode", "local-sgd", "--sync-every", "8"],
           "powersgd r=1": ["--compression", "powersgd", "--compression-rank", "1"],
           "powersgd r=4": ["--compression", "powersgd", "--compression-rank", "4"]}
LABEL = "EMULATED LINK"


def run(out: str, nproc: int = 4, link: str = "dp=1Gb/s,5ms", steps: int = 128,
        eval_every: int = 16, batch: int = 16, model: str = "tiny",
        methods: dict | None = None, progress=print) -> dict:
    """Train each method once; returns {"link", "methods": {name: row}, "png"}."""
    bw = parse_link_spec(link)["dp"].bandwidth   # refuses a bad spec before any run
    rows = {}
    for name, flags in (methods or METHODS).items():
        run_dir = Path(out) / name.replace(" ", "_").replace("=", "")
        cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(nproc), "--steps",
               str(steps), "--eval-every", str(eval_every), "--batch", str(batch), "--model",
               model, "--link", link, "--seed", "0", "--ckpt-every", str(steps),
               "--run-dir", str(run_dir), *flags]
        progress(f"slowlink: {name} ({LABEL} {link})")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows[name] = _row(run_dir)
    _compare(rows, bw)
    png = _plot(rows, Path(out) / "slowlink.png", link)
    return {"link": link, "emulated": LABEL, "nproc": nproc, "steps": steps, "batch": batch,
            "methods": rows, "png": png}


def _row(run_dir: Path) -> dict:
    """The run's summary (median step, bytes per step from the counters, final validation
    loss) and its validation curve against the running sum of step times."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_s" in rec:
            steps.append(rec)
        if "val_loss" in rec:
            evals.append((rec["step"], rec["val_loss"]))
    clock, t = {0: 0.0}, 0.0
    for rec in steps:
        t += rec["step_s"]
        clock[rec["step"]] = t
    return {"median_step_s": summary["median_step_s"],
            "bytes_per_step": summary["bytes_sent_per_step"],
            "val_loss": summary["val_loss_end"], "train_s": t,
            "curve": [(clock[s], v) for s, v in evals if s in clock]}


def _compare(rows: dict, bw: float) -> None:
    """Adds time to DDP's final validation loss and the measured crossover against DDP."""
    ddp = rows.get("ddp")
    for row in rows.values():
        row["s_to_ddp_loss"] = None if ddp is None else next(
            (t for t, v in row["curve"] if v <= ddp["val_loss"]), None)
        row["crossover_Bps"] = None
        if ddp is not None and row is not ddp:
            c_ddp = ddp["median_step_s"] - ddp["bytes_per_step"] / bw
            c = row["median_step_s"] - row["bytes_per_step"] / bw
            gap = ddp["bytes_per_step"] - row["bytes_per_step"]
            row["crossover_Bps"] = gap / (c - c_ddp) if c > c_ddp else float("inf")


def _plot(rows: dict, path: Path, link: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in rows.items():
        ax.plot(*zip(*row["curve"]), marker="o", label=name)
    ax.set_xlabel("training seconds (sum of step times)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{LABEL} {link}: validation loss against wall-clock")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def format_report(result: dict) -> str:
    head = ("method", "step ms (median)", "bytes/step", "val loss", "s to DDP's loss",
            "crossover vs DDP")
    lines = [f"{LABEL} {result['link']} ({result['nproc']} ranks, {result['steps']} steps, "
             f"batch {result['batch']}): all times include the link's modelled sleeps",
             " | ".join(head)]
    for name, r in result["methods"].items():
        t = r["s_to_ddp_loss"]
        x = r["crossover_Bps"]
        lines.append(" | ".join((name, f"{r['median_step_s'] * 1e3:.1f}",
                                 f"{r['bytes_per_step']:,.0f}", f"{r['val_loss']:.4f}",
                                 "not reached" if t is None else f"{t:.2f}",
                                 "-" if x is None else f"{x * 8 / 1e9:.3g} Gb/s")))
    lines.append(f"picture: {result['png']}")
    return "\n".join(lines)
