"""Injected faults, for the survival tests and for anyone who wants to watch a restart.

    MESHTRAIN_INJECT_FAULT="RANK:STEP"             kill -9 rank RANK as step STEP begins
    MESHTRAIN_INJECT_FAULT="RANK:STEP:checkpoint"  kill -9 it while it writes the checkpoint
                                                   of step STEP (after its share of the files,
                                                   before the checkpoint is complete)

A fault fires on the first attempt only (torch elastic's TORCHELASTIC_RESTART_COUNT is 0), so
a run started with `--max-restarts` dies once and then resumes from its latest complete
checkpoint. SIGKILL, not an exception: nothing of ours runs on the way out, as with the OOM
killer or a lost machine.
"""
from __future__ import annotations

import os
import signal

ENV = "MESHTRAIN_INJECT_FAULT"


def attempt() -> int:
    """Which attempt of the launch this process belongs to: 0, then 1 per restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse(text: str) -> tuple[int, int, str]:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("step", "checkpoint")):
            raise ValueError
        return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "step"
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: write RANK:STEP or RANK:STEP:checkpoint") from None


def maybe_kill(rank: int, step: int, point: str) -> None:
    """Kill this process if the injected fault names this rank, step and point."""
    text = os.environ.get(ENV)
    if text and attempt() == 0 and parse(text) == (rank, step, point):
        os.kill(os.getpid(), signal.SIGKILL)
