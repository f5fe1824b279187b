"""A pipeline schedule's simulated timeline, drawn (PNG) and printed (text).

One row per rank, time left to right; each forward (F) and backward (B) is a box labelled
with its micro-batch (and chunk, ".c", under interleaving); what is left blank is the
bubble. Both renderings read the same `Timeline` the simulator computes, so the picture and
the printed bubble fraction cannot disagree.
"""
from __future__ import annotations

from meshtrain.strategies.pipeline.schedules import Kind
from meshtrain.strategies.pipeline.simulator import Block, Timeline


def label(block: Block, virtual_stages: int) -> str:
    text = f"{'F' if block.kind is Kind.FORWARD else 'B'}{block.microbatch}"
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
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8.0, timeline.makespan * 0.35), 1.0 + 0.6 * timeline.ranks),
                 layout="constrained")
    ax = fig.subplots()
    colors = {Kind.FORWARD: ("#4c72b0", "#8fb0e0"), Kind.BACKWARD: ("#55a868", "#9fd4a9")}
    for b in timeline.blocks:
        color = colors[b.kind][b.chunk % 2]
        ax.broken_barh([(b.start, b.end - b.start)], (b.rank - 0.4, 0.8), facecolors=color,
                       edgecolors="white")
        ax.text((b.start + b.end) / 2, b.rank, label(b, virtual_stages), ha="center",
                va="center", fontsize=7, color="white")
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(timeline.ranks - 0.5, -0.5)        # rank 0 on top
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in range(timeline.ranks)])
    ax.set_facecolor("#eeeeee")                    # idle time shows as grey
    ax.set_xlabel("time (one stage forward = 1)")
    ax.set_title(title)
    return fig
