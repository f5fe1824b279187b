"""`meshtrain report RUN_DIR [RUN_DIR ...]`: one picture of a run (or several, to compare
plans) and its numbers in the terminal.

    meshtrain report runs/a                 # writes runs/a/report.png
    meshtrain report runs/a runs/b -o cmp.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="draw a run's loss, throughput, memory and traffic",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders made by meshtrain train")
    p.add_argument("-o", "--out", help="the PNG to write (default: the first run's report.png)")
    p.set_defaults(run=run)


def write_report(run_dirs: list, out=None) -> tuple[Path, str]:
    """Draw `run_dirs` into `out` (default <first run>/report.png); returns the path and the
    terminal summary."""
    from meshtrain.report.figure import draw, text_summary
    from meshtrain.report.run_data import read_run

    runs = [read_run(d) for d in run_dirs]
    out = Path(out) if out else runs[0].path / "report.png"
    draw(runs).savefig(out, dpi=100)
    return out, "\n".join(text_summary(r) for r in runs)


def run(args) -> int:
    from meshtrain.report.run_data import NotARun

    try:
        out, text = write_report(args.runs, args.out)
    except (NotARun, OSError) as exc:
        print(f"meshtrain report: {exc}", file=sys.stderr)
        return 2
    print(text)
    print(f"report: {out}")
    return 0
