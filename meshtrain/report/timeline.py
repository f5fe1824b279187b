"""A pipeline schedule's simulated timeline, drawn (PNG) and printed (text).

One row per rank, time left to right; each forward (F), backward (B) and weight gradient (W,
zero bubble) is a box labelled
with its micro-batch (and chunk, ".c", under interleaving); what is left blank is the
bubble. Both renderings read the same `Timeline` the simulator computes, so the picture and
the printed bubble fraction cannot disagree.
"""
from __future__ import annotations

from meshtrain.strategies.pipeline.schedules import Kind
from meshtrain.strategies.pipeline.simulator import Block, Timeline


_LETTER = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_WEIGHT: "W"}


def label(block: Block, virtual_stages: int) -> str:
    text = f"{_LETTER[block.kind]}{block.microbatch}"
    return text + (f".{block.chunk}" if virtual_stages > 1 else "")


def text_timeline(timeline: Timeline, virtual_stages: int = 1) -> str:
    """Rows of fixed-width cells: one cell per smallest compute time, idle cells '.'."""
    unit = min(b.end - b.start for b in timeline.blocks)
    width = max(len(label(b, virtual_stages)) for b in timeline.blocks) + 1
    cells = round(timeline.makespan / unit)
    rows = []
    for rank in range(timeline.ranks):
        line = ["." * width] * cells
        for b in (b for b in timeline.blocks if b.rank == rank):
            first, span = round(b.start / unit), round((b.end - b.start) / unit)
            text = label(b, virtual_stages).ljust(width * span - 1, "-") + " "
            for k in range(span):
                line[first + k] = text[k * width:(k + 1) * width]
        rows.append(f"rank {rank} |" + "".join(line) + "|")
    return "\n".join(rows)


def draw_timeline(timeline: Timeline, title: str, virtual_stages: int = 1):
    """A matplotlib Figure of the timeline (not shown: the caller saves it)."""
    fig = _figure(max(8.0, timeline.makespan / _unit(timeline) * 0.35),
                  1.0 + 0.6 * timeline.ranks)
    _draw(fig.subplots(), timeline, title, virtual_stages, "time (one stage forward = 1)")
    return fig


def draw_comparison(doc: dict):
    """A measured trace (report/trace.py) under the theory for its measured costs, on one
    time axis (ms), each titled with its bubble fraction."""
    from meshtrain.report.trace import measured_timeline, theory_timeline

    measured, theory = measured_timeline(doc), theory_timeline(doc)
    v = doc["virtual_stages"]
    width = max(8.0, max(measured.makespan, theory.makespan) / _unit(theory) * 0.35)
    fig = _figure(width, 2.0 + 1.2 * doc["pp"])
    top, bottom = fig.subplots(2, 1, sharex=True)
    head = f"{doc['schedule']}  P={doc['pp']} M={doc['microbatches']}" + (
        f" V={v}" if v > 1 else "")
    _draw(top, theory, f"{head}  theory (measured mean costs): bubble "
          f"{doc['theory']['bubble']:.3f}  [{doc['theory']['formula']} = "
          f"{doc['theory']['formula_bubble']:.3f}]", v, None, scale=1e3)
    _draw(bottom, measured, f"measured: bubble {doc['measured']['bubble']:.3f}", v, "time (ms)",
          scale=1e3)
    bottom.set_xlim(0, max(measured.makespan, theory.makespan) * 1e3)
    return fig


def _unit(timeline: Timeline) -> float:
    return min(b.end - b.start for b in timeline.blocks)


def _figure(width: float, height: float):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    return Figure(figsize=(min(width, 40.0), height), layout="constrained")


def _draw(ax, timeline: Timeline, title: str, virtual_stages: int, xlabel: str | None,
          scale: float = 1.0) -> None:
    colors = {Kind.FORWARD: ("#4c72b0", "#8fb0e0"), Kind.BACKWARD: ("#55a868", "#9fd4a9"),
              Kind.BACKWARD_WEIGHT: ("#c44e52", "#e39a9c")}
    for b in timeline.blocks:
        color = colors[b.kind][b.chunk % 2]
        start, end = b.start * scale, b.end * scale
        ax.broken_barh([(start, end - start)], (b.rank - 0.4, 0.8), facecolors=color,
                       edgecolors="white")
        ax.text((start + end) / 2, b.rank, label(b, virtual_stages), ha="center",
                va="center", fontsize=7, color="white")
    ax.set_xlim(0, timeline.makespan * scale)
    ax.set_ylim(timeline.ranks - 0.5, -0.5)        # rank 0 on top
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in range(timeline.ranks)])
    ax.set_facecolor("#eeeeee")                    # idle time shows as grey
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
