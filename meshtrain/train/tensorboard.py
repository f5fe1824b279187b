"""TensorBoard event files for a run (`meshtrain train --tensorboard`): the same numbers as
metrics.jsonl, under <run_dir>/tensorboard/, for `tensorboard --logdir runs/`.

    loss, lr, tokens_per_s, step_s, val_loss     one point per step (or evaluation)
    bytes_sent/<axis>                            bytes this rank sent per step, per mesh axis
    memory/rank<r>/<kind>                        bytes per rank by kind, at the end of the run

Needs the optional `tensorboard` package (pip install -e ".[tb]").
"""
from __future__ import annotations

from pathlib import Path

SCALARS = ("loss", "lr", "tokens_per_s", "step_s", "val_loss", "device_allocated", "device_peak")


def require_tensorboard() -> None:
    """Refuse --tensorboard, before any rank starts, where the package is missing."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package, which is not installed: "
                         "pip install -e \".[tb]\" (or drop --tensorboard)")


class TensorBoardLog:
    def __init__(self, run_dir) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        """One metrics.jsonl record."""
        step = record["step"]
        for key in SCALARS:
            if key in record:
                self.writer.add_scalar(key, record[key], step)
        for axis, sent in record.get("bytes_by_axis", {}).items():
            self.writer.add_scalar(f"bytes_sent/{axis}", sent, step)

    def write_memory(self, memory_per_rank: list[dict], step: int) -> None:
        for rank, kinds in enumerate(memory_per_rank):
            for kind, value in kinds.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"memory/rank{rank}/{kind}", value, step)

    def close(self) -> None:
        self.writer.close()
