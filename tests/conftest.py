"""The suite runs on the CPU wherever it runs: a GPU machine's `auto` would move the
one-process references' peers (and `meshtrain train`'s ranks) onto CUDA. The CUDA tier
(tests/gpu) asks for its device by name: `run_ranks(..., device="cuda")`."""
import os

from meshtrain.core.device import DEVICE_ENV

os.environ.setdefault(DEVICE_ENV, "cpu")
