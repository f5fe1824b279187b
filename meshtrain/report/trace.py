"""A pipeline step's measured trace: every rank's forwards, backwards and weight gradients
(and its communication apart), put on one time axis, compared with theory, saved as JSON and
in Chrome's trace format (open it in https://ui.perfetto.dev or chrome://tracing).

The ranks' traces are aligned on time.perf_counter, which local processes share (Linux's
monotonic clock); across hosts it would not be, and each rank's own step start is used.
The measured bubble is the theory's definition applied to the measured timeline: the idle
fraction of P ranks between the first compute's start and the last compute's end.
The theory beside it is the simulator run with the measured mean costs of F, B and W, so
that the two pictures share their time axis; the closed formula is given too.
"""
from __future__ import annotations

import json
from pathlib import Path

from meshtrain.strategies.pipeline.schedules import Kind, bubble_formula, build_schedule
from meshtrain.strategies.pipeline.simulator import Block, Timeline, simulate

SCHEMA = "meshtrain.pipeline_trace/1"


def rank_record(trace: Timeline, pp_rank: int, host: str = "") -> dict:
    """One rank's trace, JSON-ready, in absolute perf_counter seconds."""
    def rows(blocks):
        return [[b.kind.value, b.microbatch, b.chunk, trace.origin + b.start,
                 trace.origin + b.end] for b in blocks]
    return {"pp_rank": pp_rank, "host": host, "blocks": rows(trace.blocks),
            "waits": rows(trace.waits)}


def trace_document(records: list[dict], schedule: str, microbatches: int,
                   virtual_stages: int = 1, step: int | None = None) -> dict:
    """The pipeline's trace (one record per pp rank): times in seconds from the first
    event, the measured bubble, and the theory for the measured costs."""
    records = sorted(records, key=lambda r: r["pp_rank"])
    pp = len(records)
    aligned = len({r["host"] for r in records}) == 1
    def first(r):   # a rank's first event: often the receive its first forward waits for
        return min(row[3] for part in ("blocks", "waits") for row in r[part])
    t0 = min(first(r) for r in records)
    ranks = []
    for r in records:
        own = t0 if aligned else first(r)
        ranks.append({"pp_rank": r["pp_rank"],
                      **{part: [{"kind": k, "microbatch": i, "chunk": c,
                                 "start": s - own, "end": e - own} for k, i, c, s, e in r[part]]
                         for part in ("blocks", "waits")}})
    measured = measured_timeline({"pp": pp, "ranks": ranks})
    costs = mean_costs(measured, virtual_stages)
    theory = simulate(build_schedule(schedule, pp, microbatches, virtual_stages),
                      costs["forward"], costs["backward"], virtual_stages, costs["weight"])
    formula_value, formula = bubble_formula(schedule, pp, microbatches, virtual_stages,
                                            costs["forward"], costs["backward"],
                                            costs["weight"])
    return {"schema": SCHEMA, "schedule": schedule, "pp": pp, "microbatches": microbatches,
            "virtual_stages": virtual_stages, "step": step, "aligned_clock": aligned,
            "measured": {"bubble": measured.bubble, "makespan_s": measured.makespan},
            "theory": {"bubble": theory.bubble, "makespan_s": theory.makespan,
                       "formula": formula, "formula_bubble": formula_value, "costs_s": costs},
            "ranks": ranks}


def measured_timeline(doc: dict) -> Timeline:
    """The document's measured compute as a Timeline (the simulator's type, so that it is
    drawn and its bubble computed as theory's are)."""
    blocks = [Block(r["pp_rank"], Kind(b["kind"]), b["microbatch"], b["chunk"], b["start"],
                    b["end"]) for r in doc["ranks"] for b in r["blocks"]]
    start = min(b.start for b in blocks)
    blocks = [Block(b.rank, b.kind, b.microbatch, b.chunk, b.start - start, b.end - start)
              for b in blocks]
    busy = [sum(b.end - b.start for b in blocks if b.rank == r) for r in range(doc["pp"])]
    return Timeline(blocks, doc["pp"], max(b.end for b in blocks), busy)


def mean_costs(timeline: Timeline, virtual_stages: int = 1) -> dict:
    """Mean seconds of a stage's forward, whole backward (B + W) and weight gradient, as
    the simulator takes them (a chunk is 1/V of a stage)."""
    def mean(kind):
        spans = [b.end - b.start for b in timeline.blocks if b.kind is kind]
        return virtual_stages * sum(spans) / len(spans) if spans else 0.0
    weight = mean(Kind.BACKWARD_WEIGHT)
    return {"forward": mean(Kind.FORWARD), "backward": mean(Kind.BACKWARD) + weight,
            "weight": weight if weight else None}


def chrome_trace(doc: dict) -> dict:
    """Chrome's trace-event format: one process per pp rank, a compute and a
    communication thread in each; microseconds."""
    events = []
    for r in doc["ranks"]:
        pid = r["pp_rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"pp rank {pid}"}})
        for tid, name in ((0, "compute"), (1, "communication")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
        for tid, part in ((0, "blocks"), (1, "waits")):
            for b in r[part]:
                short = {"forward": "F", "backward": "B", "backward_weight": "W"}.get(
                    b["kind"], b["kind"])
                events.append({"name": f"{short}{b['microbatch']}"
                                       + (f".{b['chunk']}" if doc["virtual_stages"] > 1 else ""),
                               "cat": b["kind"], "ph": "X", "ts": b["start"] * 1e6,
                               "dur": (b["end"] - b["start"]) * 1e6, "pid": pid, "tid": tid,
                               "args": {"microbatch": b["microbatch"], "chunk": b["chunk"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": doc["schedule"], "pp": doc["pp"],
                          "microbatches": doc["microbatches"],
                          "measured_bubble": doc["measured"]["bubble"],
                          "theory_bubble": doc["theory"]["bubble"]}}


def save_trace(doc: dict, folder: str | Path, name: str = "trace") -> dict[str, Path]:
    """<name>.json, <name>.chrome.json and <name>.png (measured beside theory) in `folder`."""
    from meshtrain.report.timeline import draw_comparison

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{name}.json", "chrome": folder / f"{name}.chrome.json",
             "png": folder / f"{name}.png"}
    paths["json"].write_text(json.dumps(doc, indent=1))
    paths["chrome"].write_text(json.dumps(chrome_trace(doc)))
    draw_comparison(doc).savefig(paths["png"], dpi=100)
    return paths


def theory_timeline(doc: dict) -> Timeline:
    costs = doc["theory"]["costs_s"]
    return simulate(build_schedule(doc["schedule"], doc["pp"], doc["microbatches"],
                                   doc["virtual_stages"]), costs["forward"], costs["backward"],
                    doc["virtual_stages"], costs["weight"])
