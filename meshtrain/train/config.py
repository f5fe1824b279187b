"""A run's configuration and its folder's bookkeeping, without importing torch: the command
reads and validates these before it starts any rank.

    config.json       the RunConfig (resume reads it back)
    checkpoints/      step_XXXXXXXX/ folders and `latest`, the name of the newest complete one
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshtrain.train.errors import CheckpointError


@dataclass
class RunConfig:
    run_dir: str
    plan: dict = field(default_factory=dict)
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    seq_len: int | None = None     # the data's window for a model other than the GPT presets
    loss: str = "auto"             # "auto" (the model's .loss, else cross-entropy) | "cross-entropy"
    data: str | None = None
    steps: int = 250
    batch_size: int = 32          # global batch, sequences
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    max_grad_norm: float | None = None
    offload_dir: str | None = None   # offload="disk": default <run_dir>/offload
    started_at: float | None = None  # when the command started (for the time to first step)
    resume: bool = False
    progress: bool = True
    tensorboard: bool = False        # also write TensorBoard event files (<run_dir>/tensorboard)
    straggler: list | None = None    # [rank, seconds]: that rank is delayed every step

    def save(self) -> None:
        path = Path(self.run_dir) / "config.json"
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir) -> "RunConfig":
        """The run in `run_dir`, wherever that folder is now: a run folder that was moved or
        copied reads and writes only itself (the `run_dir` it was saved with is ignored)."""
        path = Path(run_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{run_dir} is not a meshtrain run folder (no config.json); "
                                    "pass the folder a previous `meshtrain train` printed")
        try:
            saved = json.loads(path.read_text())
            return cls(**dict(saved, run_dir=str(run_dir)))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"{path} is not a valid run configuration ({exc}); pass the "
                             "folder a previous `meshtrain train` printed") from None


def learning_rate(config: RunConfig, step: int) -> float:
    """Linear warm-up, then constant: a function of the step alone (resume-exact)."""
    return config.lr * min(1.0, (step + 1) / max(1, config.warmup))


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint `checkpoints/latest` names, inside `run_dir` (None before the first)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not re.fullmatch(r"step_\d{8}", name):   # a name, never a path out of the run folder
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a checkpoint of this run "
                              "(step_XXXXXXXX); the run folder is damaged")
    return Path(run_dir) / "checkpoints" / name


def write_latest(run_dir, name: str) -> None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, pointer)  # atomic: `latest` always names a complete checkpoint
