"""One picture of one or more runs: four panels drawn from the runs' own numbers.

    loss             train loss per step (line), validation loss per evaluation (markers)
    tokens/s         per step
    memory per rank  bars by kind: parameters, gradients, optimizer states, activations, and
                     what is on disk or gathered at most (ZeRO offload, ZeRO-3)
    bytes per step   bytes each rank sent per step, per mesh axis (mean over the steps)

Each line and bar carries the run's label, so a test (or a reader) can read the numbers back
from the figure itself.
"""
from __future__ import annotations

import statistics

from meshtrain.report.run_data import RunData

MEMORY_KINDS = (("parameters", "params"), ("gradients", "grads"),
                ("optimizer_states", "optimizer"), ("activations", "activations"),
                ("offloaded", "on disk"), ("gathered_peak", "gathered peak"))


def draw(runs: list[RunData]):
    """A matplotlib Figure of `runs` (not shown: the caller saves it)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    loss_ax, speed_ax, memory_ax, bytes_ax = fig.subplots(2, 2).flatten()
    for i, run in enumerate(runs):
        color = f"C{i}"
        loss_ax.plot(run.steps, run.loss, color=color, label=f"{run.label} train")
        if run.eval_steps:
            loss_ax.plot(run.eval_steps, run.val_loss, "o--", color=color,
                         label=f"{run.label} val")
        speed_ax.plot(run.steps, run.tokens_per_s, color=color, label=run.label)
    _titled(loss_ax, "loss", "step", "loss")
    _titled(speed_ax, "throughput", "step", "tokens / s")
    _memory_bars(memory_ax, runs)
    _bytes_bars(bytes_ax, runs)
    fig.suptitle(" vs ".join(run.label for run in runs))
    return fig


def _titled(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _memory_bars(ax, runs: list[RunData]) -> None:
    """Stacked bars per (run, rank), MiB by kind."""
    positions, names = [], []
    for i, run in enumerate(runs):
        for rank, memory in enumerate(run.memory_per_rank):
            x = len(positions)
            positions.append(x)
            names.append(f"{run.label}\nrank {rank}" if len(runs) > 1 else f"rank {rank}")
            bottom = 0.0
            for k, (key, kind) in enumerate(MEMORY_KINDS):
                value = (memory.get(key) or 0) / 2**20
                ax.bar(x, value, bottom=bottom, color=f"C{k}",
                       label=kind if x == 0 else None, gid=f"{i}/{rank}/{key}")
                bottom += value
    ax.set_xticks(positions, names, fontsize="small")
    _titled(ax, "memory per rank" if positions else "memory per rank (the run has not ended)",
            "", "MiB")


def _bytes_bars(ax, runs: list[RunData]) -> None:
    """Mean bytes sent per step per axis, a group of bars per run."""
    axes = sorted({a for run in runs for a in run.bytes_by_axis})
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        means = [statistics.mean(run.bytes_by_axis[a]) / 2**20 if run.bytes_by_axis.get(a)
                 else 0.0 for a in axes]
        ax.bar([j + i * width for j in range(len(axes))], means, width, color=f"C{i}",
               label=run.label, gid=f"{i}/bytes")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(axes))], axes)
    _titled(ax, "sent per rank per step, by mesh axis", "axis", "MiB")


def text_summary(run: RunData) -> str:
    """The run's numbers in a few lines for the terminal."""
    lines = [f"{run.label}: {run.path}"]
    if run.loss:
        lines.append(f"  train loss  {run.loss[0]:.4f} -> {run.loss[-1]:.4f} over "
                     f"{len(run.loss)} steps")
    if run.val_loss:
        lines.append(f"  val loss    {run.val_loss[0]:.4f} -> {run.val_loss[-1]:.4f}")
    if run.tokens_per_s:
        lines.append(f"  tokens/s    median {statistics.median(run.tokens_per_s):,.0f}")
    if run.mfu:
        peak = (f" (peak {run.peak_flops / 1e12:.3g} TFLOP/s per device, {run.peak_source})"
                if run.peak_flops else " (the run did not record its peak)")
        lines.append(f"  MFU         median {statistics.median(run.mfu):.2%}{peak}")
    elif run.steps:
        lines.append("  MFU         none (the run's metrics record no MFU)")
    for axis, sent in run.bytes_by_axis.items():
        lines.append(f"  sent/step   {axis}: {statistics.mean(sent) / 2**20:,.2f} MiB")
    for rank, m in enumerate(run.memory_per_rank):
        states = sum(m.get(k) or 0 for k in ("parameters", "gradients", "optimizer_states"))
        gpu = (f", GPU peak {m['device_peak'] / 2**20:,.1f} MiB"
               if m.get("device_peak") is not None else "")
        lines.append(f"  rank {rank}      model states {states / 2**20:,.1f} MiB, "
                     f"activations {(m.get('activations') or 0) / 2**20:,.1f} MiB{gpu}")
    return "\n".join(lines)
