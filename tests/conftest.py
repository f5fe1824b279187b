"""The suite runs on the CPU wherever it runs: a GPU machine's `auto` would move the
one-process references' peers (and `meshtrain train`'s ranks) onto CUDA. The CUDA tier
(tests/gpu) asks for its device by name: `run_ranks(..., device="cuda")`.

The suite runs on three xdist workers (pyproject's addopts). A test marked `alone` measures
wall-clock timelines, which the other workers' load would stretch: it runs with no other
test in flight, through a writer-first lock shared by the workers (a reader lock around every
other test, a turnstile so that waiting `alone` tests are not starved).

OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning: the workers,
their one-process references and their ranks outnumber the cores, and a thread spinning for
work that is not coming takes a core from a process that has some (the suite runs about a
third faster; thread counts, and so every number, are unchanged). Set before torch loads
its OpenMP runtime, which reads it once; the ranks and commands the tests start inherit it."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import fcntl  # noqa: E402
import hashlib  # noqa: E402
import tempfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import pytest  # noqa: E402

from meshtrain.core.device import DEVICE_ENV  # noqa: E402

os.environ.setdefault(DEVICE_ENV, "cpu")


# The file with `alone` tests first (they open it), so they wait for the other workers'
# first, short tests rather than for a long test in flight mid-suite; then the longest files
# (about 40 s to 4 min each): the workers take whole files in collection order, and a long
# file started last would leave the others idle at the end.
SLOWEST_FIRST = ["test_pipeline_trace.py", "test_hybrid.py", "test_pipeline.py",
                 "test_compile.py", "test_cli_train.py", "test_own_model.py", "test_survival.py",
                 "test_zero.py", "test_zero3.py", "test_hf_cli.py", "test_hf_models.py",
                 "test_tensor_parallel.py", "test_bench_slowlink.py", "test_plan_verify.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order kept


def _lock_path(config, name: str) -> str:
    suite = hashlib.sha1(str(config.rootpath).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"meshtrain-tests-{suite}.{name}.lock")


@contextmanager
def _flock(path: str, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    turnstile, room = (_lock_path(item.config, n) for n in ("turnstile", "room"))
    if item.get_closest_marker("alone"):
        with _flock(turnstile, fcntl.LOCK_EX), _flock(room, fcntl.LOCK_EX):
            yield
        return
    with _flock(turnstile, fcntl.LOCK_EX):
        room_lock = open(room, "a")
        fcntl.flock(room_lock, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(room_lock, fcntl.LOCK_UN)
        room_lock.close()
