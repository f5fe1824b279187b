"""DDP against DiLoCo, local SGD and PowerSGD over an emulated slow dp link (`meshtrain bench slowlink`).

Each method is one `meshtrain train` run (same model, data, seed, steps and global batch, so
the same tokens) with `--link`; the figures come from its metrics.jsonl: the median step
time, the bytes each step sent (the accounted counters), the validation loss at equal tokens
and, against DDP, the steps and training seconds (sum of step times, evaluations excluded)
each takes to reach a loss both reach (the higher of the two final validation losses; the
step it is crossed at interpolated between evaluations, every 4 steps by default; a
method's warm-up steps, which are DDP's, timed by DDP's run). Every figure is EMULATED: the
link sleeps its modelled time (core/link.py).

Crossover against DDP: the bandwidth below which the method reaches that common loss
sooner, measured from the runs' own records and predicted by the planner from the same
steps' measured compute and its own link model, side by side (slowlink_crossover.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from meshtrain.bench import slowlink_crossover as xover
from meshtrain.core.link import parse_link_spec

# outer momentum 0.5, not the paper's 0.9: at these few outer steps 0.9's amplification
# (about 7x a round's delta) costs more than it gains (docs/diloco.md)
DILOCO = ["--dp-mode", "diloco", "--outer-momentum", "0.5", "--sync-every"]
METHODS = {"ddp": [], "diloco H=8": DILOCO + ["8"], "diloco H=32": DILOCO + ["32"],
           "local-sgd H=8": ["--dp-mode", "local-sgd", "--sync-every", "8"],
           "powersgd r=1": ["--compression", "powersgd", "--compression-rank", "1"],
           "powersgd r=4": ["--compression", "powersgd", "--compression-rank", "4"]}
LABEL = "EMULATED LINK"


def pick(names: list[str] | None) -> dict | None:
    """The methods named (all where None); an unknown name is refused with the known ones."""
    if names is None:
        return None
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown slowlink method(s) {unknown}; choose from {list(METHODS)}")
    return {n: METHODS[n] for n in names}


def run(out: str, nproc: int = 4, link: str = "dp=1Gb/s,5ms", steps: int = 128,
        eval_every: int = 4, batch: int = 16, model: str = "tiny", seq: int | None = None,
        methods: dict | None = None, sync_warmup: int = 0, progress=print) -> dict:
    """Train each method once (every one but DDP after `sync_warmup` DDP steps), evaluated
    every `eval_every` steps (outside the step times); returns
    {"link", "methods": {name: row}, "png"}."""
    dp_link = parse_link_spec(link)["dp"]   # refuses a bad spec before any run
    bw = dp_link.bandwidth
    warm = ["--sync-warmup-steps", str(sync_warmup)] if sync_warmup else []
    methods = {name: flags + (warm if flags else [])
               for name, flags in (methods or METHODS).items()}
    rows = {}
    for name, flags in methods.items():
        run_dir = Path(out) / name.replace(" ", "_").replace("=", "")
        shutil.rmtree(run_dir, ignore_errors=True)   # the bench's own: a new run each time
        cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(nproc), "--steps",
               str(steps), "--eval-every", str(eval_every), "--batch", str(batch), "--model",
               model, "--link", link, "--seed", "0", "--ckpt-every", str(steps),
               "--run-dir", str(run_dir), "--no-progress",
               *(["--seq", str(seq)] if seq else []), *flags]
        progress(f"slowlink: {name} ({LABEL} {link})")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows[name] = _row(run_dir, bw)
    _compare(rows, methods, dict(model=model, nproc=nproc, batch=batch, seq=seq,
                                 latency=dp_link.latency))
    png = _plot(rows, Path(out) / "slowlink.png", link)
    return {"link": link, "emulated": LABEL, "nproc": nproc, "steps": steps, "batch": batch,
            "seq": seq,
            "sync_warmup": sync_warmup, "methods": rows, "png": png}


def _row(run_dir: Path, bw: float) -> dict:
    """The run's summary (median step, bytes per step from the counters, final validation
    loss), its validation curve against the running sum of step times, and per step its
    seconds, its seconds less the link's bandwidth term with its bytes
    (slowlink_crossover.reach), and its compute: seconds less all the link slept."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records, step_s, compute, evals, t = [], [], [], [], 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_s" in rec:
            t += rec["step_s"]
            step_s.append(rec["step_s"])
            records.append((rec["step_s"] - rec["bytes_sent"] / bw, rec["bytes_sent"]))
            compute.append(rec["step_s"] - rec["link_s"])
        if "val_loss" in rec:
            evals.append((rec["step"], t, rec["val_loss"]))
    return {"median_step_s": summary["median_step_s"],
            "bytes_per_step": summary["bytes_sent_per_step"],
            "val_loss": summary["val_loss_end"], "train_s": t,
            "curve": [(clock, v) for _, clock, v in evals], "evals": evals,
            "records": records, "step_s": step_s, "compute": compute}


def _compare(rows: dict, methods: dict, link: dict) -> None:
    """Against DDP, at the loss both reach (the step it is crossed at interpolated between
    evaluations; a method's warm-up steps timed by DDP's run): seconds each takes, the
    speed-up, and the crossover bandwidth measured and predicted by the planner from the
    same steps' compute."""
    ddp = rows.get("ddp")
    for name, row in rows.items():
        row.update(target_loss=None, s_to_target=None, ddp_s_to_target=None, speedup=None,
                   crossover_Bps=None, planner_crossover_Bps=None, steps_to_target=None,
                   ddp_steps_to_target=None)
        if ddp is None or row is ddp:
            continue
        target = max(ddp["val_loss"], row["val_loss"])
        plan = xover.plan_of(methods[name], link["nproc"])
        warmed = _warmed_by(row, ddp, plan.sync_warmup_steps)
        mine, theirs = xover.reach(warmed, target, True), xover.reach(ddp, target, True)
        row["target_loss"] = target
        if mine is None or theirs is None:
            continue
        row["steps_to_target"], row["ddp_steps_to_target"] = mine[0], theirs[0]
        row["s_to_target"], row["ddp_s_to_target"] = mine[1], theirs[1]
        row["speedup"] = row["ddp_s_to_target"] / row["s_to_target"]
        row["crossover_Bps"] = xover.measured_crossover(theirs, mine)
        row["planner_crossover_Bps"] = xover.planner_crossover_at_target(
            link["model"], link["nproc"], link["batch"], link["seq"], link["latency"],
            plan, (theirs[0], xover.upto(ddp["compute"], theirs[0])),
            (mine[0], xover.upto(warmed["compute"], mine[0])))


def _warmed_by(row: dict, ddp: dict, k: int) -> dict:
    """`row` with its first `k` (warm-up) steps timed by DDP's run: they are DDP's steps,
    the same work and bytes (checked on the counters), so the seconds the two runs took for
    them differ by machine noise alone, which would otherwise land whole in the difference
    of the times to the target. Unchanged where the bytes differ."""
    if not k or [s for _, s in row["records"][:k]] != [s for _, s in ddp["records"][:k]]:
        return row
    return dict(row, **{key: ddp[key][:k] + row[key][k:]
                        for key in ("records", "step_s", "compute")})


def _plot(rows: dict, path: Path, link: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in rows.items():
        ax.plot(*zip(*row["curve"]), marker="o", label=name)
    ax.set_xlabel("training seconds (sum of step times)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{LABEL} {link}: validation loss against wall-clock", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x * 8 / 1e9:.3g} Gb/s"


def format_report(result: dict) -> str:
    head = ("method", "step ms (median)", "bytes/step", "val loss", "common loss",
            "steps to it (method / DDP)", "s to it (method / DDP)", "speed-up",
            "crossover measured", "crossover planner")
    seq = f" x seq {result['seq']}" if result.get("seq") else ""
    lines = [f"{LABEL} {result['link']} ({result['nproc']} ranks, {result['steps']} steps, "
             f"batch {result['batch']}{seq}, {result.get('sync_warmup', 0)} DDP warm-up steps "
             "before each other method): all times include the link's modelled sleeps",
             " | ".join(head)]
    for name, r in result["methods"].items():
        missing = "-" if r["target_loss"] is None else "not reached"
        reached = (missing if r["s_to_target"] is None
                   else f"{r['s_to_target']:.1f} / {r['ddp_s_to_target']:.1f}")
        steps = (missing if r["steps_to_target"] is None
                 else f"{r['steps_to_target']:.1f} / {r['ddp_steps_to_target']:.1f}")
        lines.append(" | ".join((
            name, f"{r['median_step_s'] * 1e3:.1f}", f"{r['bytes_per_step']:,.0f}",
            f"{r['val_loss']:.4f}", "-" if r["target_loss"] is None else f"{r['target_loss']:.4f}",
            steps, reached, "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            _gbps(r["crossover_Bps"]), _gbps(r["planner_crossover_Bps"]))))
    lines.append(f"picture: {result['png']}")
    return "\n".join(lines)
