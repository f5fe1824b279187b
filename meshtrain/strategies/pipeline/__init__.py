"""Pipeline parallel (slots 2 and 5 on the pp axis): the model's layers cut into stages,
driven by a schedule that is data.

    partition.py   which layers make each stage (balanced by compute or parameters, or cuts)
    stages.py      PipelineStages: the Stages slot (this rank's chunks, tied weights, merge)
    schedules.py   naive, GPipe, 1F1B, interleaved 1F1B, zero bubble (ZB-H1) as per-rank
                   action lists
    simulator.py   runs all ranks' lists in one process: deadlocks, timeline, bubble
    runtime.py     PipelineSchedule: the StepDriver slot, one executor for every list
    boundary.py    what crosses a stage boundary (a tensor or a tuple) and its shape header
(report/timeline.py draws a simulated timeline; `meshtrain schedule` prints it;
report/trace.py saves and draws a measured one beside it.)
"""
from __future__ import annotations

from meshtrain.strategies.pipeline.partition import check
from meshtrain.strategies.pipeline.runtime import PipelineError, PipelineSchedule
from meshtrain.strategies.pipeline.stages import PipelineStages, keep_stages

__all__ = ["check", "keep_stages", "PipelineError", "PipelineSchedule", "PipelineStages"]
