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


OPTIMIZERS = ("adamw", "sgd")
DEFAULT_LR = {"adamw": 3e-3, "sgd": 0.1}   # each tuned for the default tiny GPT and batch


@dataclass
class RunConfig:
    run_dir: str
    plan: dict = field(default_factory=dict)   # the whole Plan (Plan.to_dict): resume reads it
    model: str = "tiny"
    device: str = "auto"           # where the ranks run: cpu | cuda (auto: resolved per rank)
    model_overrides: dict = field(default_factory=dict)
    seq_len: int | None = None     # the data's window for a model other than the GPT presets
    loss: str = "auto"             # "auto" (the model's .loss, else cross-entropy) | "cross-entropy"
    data: str | None = None
    init_from: str | None = None   # a transformers model folder the weights start from
    tokenizer: str | None = None   # the model's tokenizer (a copy is kept in run_dir/tokenizer)
    steps: int = 250
    batch_size: int = 32          # global batch, sequences
    optimizer: str = "adamw"       # "adamw" | "sgd" (with momentum, no weight decay)
    lr: float = 3e-3
    momentum: float = 0.9          # sgd's
    warmup: int | None = None      # lr warm-up steps (None: 30, or a quarter of `steps` if fewer)
    weight_decay: float = 0.1      # adamw's (decoupled)
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    started_at: float | None = None  # when the command started (for the time to first step)
    resume: bool = False
    progress: bool = True
    tensorboard: bool = False        # also write TensorBoard event files (<run_dir>/tensorboard)
    collective_timeout: float = 300.0  # seconds a collective may wait before the watchdog
    check_collectives: bool = False  # compare the ranks' first-step call sequences
    straggler: list | None = None    # [rank, seconds]: that rank is delayed every step
    trace: bool = False              # pipeline: save the last step's measured trace (trace.*)
    link: str | None = None          # emulated slow link, e.g. "dp=1Gb/s,5ms" (core/link.py)
    # set by the run at its start, not by the user: the per-device peak FLOP/s MFU is
    # against and where it came from, so `meshtrain report` states it for a run cut short
    peak_flops: float | None = None
    peak_source: str | None = None

    def __post_init__(self) -> None:
        if self.warmup is None:   # settled once, saved: a resume keeps the run's own
            self.warmup = min(30, self.steps // 4)

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
            # runs saved before these knobs joined the Plan kept them beside it
            moved = {k: saved.pop(k) for k in ("max_grad_norm", "offload_dir") if k in saved}
            if isinstance(saved.get("plan"), dict):
                saved["plan"].update({k: v for k, v in moved.items() if v is not None})
            return cls(**dict(saved, run_dir=str(run_dir)))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"{path} is not a valid run configuration ({exc}); pass the "
                             "folder a previous `meshtrain train` printed") from None


def check_run_config(config: RunConfig) -> None:
    """Refuse, in the command's process and before any rank starts, a value no rank could
    train with: each message names the option and what it accepts."""
    whole = {"--steps": (config.steps, 1), "--batch": (config.batch_size, 1),
             "--eval-every": (config.eval_every, 1), "--ckpt-every": (config.ckpt_every, 1),
             "--warmup": (config.warmup, 0), "--seed": (config.seed, 0)}
    for flag, (value, least) in whole.items():
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{flag} {value}: give a whole number >= {least}")
    if config.seed >= 2**63:
        raise ValueError(f"--seed {config.seed}: give a number below 2**63")
    if not config.lr > 0:
        raise ValueError(f"--lr {config.lr:g}: the learning rate must be a positive number")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {config.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if not 0 <= config.momentum < 1:
        raise ValueError(f"--momentum {config.momentum:g}: give a number in [0, 1)")
    if not config.collective_timeout > 0:
        raise ValueError(f"--collective-timeout {config.collective_timeout:g}: give a positive "
                         "number of seconds")
    done = latest_checkpoint(config.run_dir) if config.resume else None
    if done is not None and config.steps <= int(done.name.removeprefix("step_")):
        raise ValueError(f"--steps {config.steps}: {config.run_dir} is already at step "
                         f"{int(done.name.removeprefix('step_'))} (its latest checkpoint); give "
                         "a larger --steps to continue it")
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir}: a file of that name exists; give a folder")
    if config.data is not None and not any(c in config.data for c in ",@*"):   # one path
        data = Path(config.data)
        if not data.exists():
            raise FileNotFoundError(f"--data {data}: no such file or folder; give a text file "
                                    "or a folder of text files (default: Python's standard "
                                    "library)")
        if data.is_file() and data.stat().st_size == 0:
            raise ValueError(f"--data {data}: the file is empty; give a text file with text")


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
