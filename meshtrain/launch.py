"""Run a function on N local ranks through torch's elastic launcher (the engine of torchrun).

`launch(fn, nproc, args)` starts an elastic agent in this process that rendezvouses on
loopback (c10d store on 127.0.0.1, never all interfaces), starts `nproc` workers, and
returns their return values in rank order. Each worker joins the default process group
(gloo on CPU; on CUDA "cpu:gloo,cuda:nccl", one GPU per rank) before `fn` runs and leaves
it afterwards.

[Note: results survive teardown]
Each worker writes its result to a file *before* tearing its process group down, so a rank
killed by the known gloo teardown abort (SIGABRT after training finished) cannot lose a
finished result: if every rank has written one, `launch` returns them and warns about the
abort. A rank that fails earlier makes `launch` raise `LaunchError` with that rank's
traceback; the elastic agent then stops the other workers, so none is left hanging.

[Note: what is unpickled here]
Only what this process tree made: the arguments travel to the workers it starts (the
elastic agent's multiprocessing), and the results come back through files in a private
temporary directory (mkdtemp: mode 0700, a fresh random name) that only these workers write.
Nothing from a user's files or the network is ever unpickled.

[Note: the first failure is often an echo]
When `fn` raises on one rank, its peers' next collective fails with "connection closed" and
can exit before it does; the agent then reports only the echo and terminates the rank that
raised, losing its traceback. So a worker whose `fn` raises writes its traceback to a file
first (as results are), and `LaunchError` lists those before the agent's failures.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import tempfile
import traceback
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

from meshtrain.core.processes import (forkserver_context, function_ref, resolve_function,
                                      threads_per_rank)


class LaunchError(RuntimeError):
    """A rank failed; the message names it and carries its traceback.

    `raised` maps each rank whose function raised to {"type", "message", "traceback"},
    earliest first, so that a caller can answer a known error in one line."""

    def __init__(self, text: str, raised: dict[int, dict] | None = None,
                 culprits: list[str] | None = None) -> None:
        super().__init__(text)
        self.raised = raised or {}
        self.culprits = culprits or []
        """One line per failed rank, the likely cause first: a rank that died (a signal, an
        exit without raising) before one that raised, whose error is often only the echo."""

    def first_raised(self) -> dict | None:
        return next(iter(self.raised.values()), None)


def init_distributed(timeout_s: float = 600.0, device: str | None = None):
    """Join the default process group from torchrun/elastic's environment; set threads.

    `device` (auto | cpu | cuda; default MESHTRAIN_DEVICE, else auto) is resolved here and
    left in this rank's MESHTRAIN_DEVICE, where the mesh reads it; on CUDA this rank's GPU is
    LOCAL_RANK's. Returns the backend. Safe to call when already initialised."""
    import torch
    import torch.distributed as dist

    from meshtrain.core.device import DEVICE_ENV, resolve_device
    from meshtrain.core.mesh import device_for_backend

    from meshtrain.core import watchdog

    os.environ[DEVICE_ENV] = resolve_device(device)
    where, backend = device_for_backend()
    if where.type == "cuda":
        torch.cuda.set_device(where)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(threads_per_rank(local_world))
    if not dist.is_initialized():   # on NCCL, past our watchdog's: see core/watchdog.py
        timeout = timedelta(seconds=watchdog.configure(timeout_s, backend))
        store = _store_of_this_attempt(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    return backend


def _store_of_this_attempt(timeout):
    """After an elastic restart, the agent's store under a prefix of this attempt (None on
    the first attempt: env:// as usual).

    torch elastic hands every attempt the same store, unprefixed (it is the rendezvous's
    own); a restarted group would find the dead attempt's keys there, gloo's peer
    addresses among them, and could wait forever on a dead port."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshtrain/attempt{attempt}", store)


def shutdown_distributed(exit_code: int | None = None) -> None:
    """A barrier, then the process group's teardown. With `exit_code`, the process then
    ends at once: gloo's threads can abort the interpreter's exit with SIGABRT after a
    finished run ("terminate called without an active exception", docs/history.md), which would
    turn a run torchrun launched into a failure; everything the run writes is closed by
    then, so the exit skips only those destructors."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # cuts the teardown abort's frequency (docs/history.md)
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _worker(ref, payload: bytes, result_dir: str, collective_timeout_s: float = 600.0,
            device: str | None = None):
    """Entry point of one elastic worker: init, run, save the result, then tear down."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # writes this rank's traceback where the agent reads it
    def run():
        init_distributed(collective_timeout_s, device)
        fn = resolve_function(ref)
        args, kwargs = pickle.loads(payload)
        rank = int(os.environ["RANK"])
        for stale in (f"rank{rank}.err", f"rank{rank}.stopped"):   # a failed attempt's
            (Path(result_dir) / stale).unlink(missing_ok=True)
        _note_when_stopped(Path(result_dir) / f"rank{rank}.stopped")
        _report_stalls(Path(result_dir) / f"rank{rank}.err")
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # see [Note: the first failure is often an echo]
            (Path(result_dir) / f"rank{rank}.err").write_text(json.dumps({
                "type": type(exc).__name__, "message": str(exc),
                "traceback": traceback.format_exc()}))
            if isinstance(exc, (Exception, KeyboardInterrupt, SystemExit)):
                raise
            # DCP's CheckpointException is a BaseException: torch's worker wrapper would let
            # it through to multiprocessing, which prints it whole on the console
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        tmp = Path(result_dir) / f"rank{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.replace(Path(result_dir) / f"rank{rank}.pkl")
        shutdown_distributed()

    run()


def _report_stalls(err_file: Path) -> None:
    """A stall the watchdog diagnoses (NCCL: the host is blocked, nothing raises) is this
    rank's error, written as a raised one is, and the process ends."""
    from meshtrain.core import watchdog

    def report(message: str) -> None:
        err_file.write_text(json.dumps({"type": "CollectiveFailure", "message": message,
                                        "traceback": f"CollectiveFailure: {message}\n"}))
        watchdog._exit_on_stall(message)
    watchdog.stall_handler = report


def _note_when_stopped(marker: Path) -> None:
    """The agent stops the survivors of a failure with SIGTERM: leave a mark first, so that
    a rank with neither a result, an error nor this mark is known to have died on its own
    (kill -9, the OOM killer, a crash)."""
    import signal

    def stopped(signum, frame):
        marker.touch()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)


def launch(fn, nproc: int, args: tuple = (), kwargs: dict | None = None,
           start_method: str = "forkserver", timeout_s: float = 900.0,
           max_restarts: int = 0, collective_timeout_s: float = 600.0,
           device: str | None = None) -> list:
    """Run `fn(*args, **kwargs)` on `nproc` local ranks; return the results in rank order.

    `device`: auto (CUDA when a GPU is visible), cpu or cuda; None reads MESHTRAIN_DEVICE,
    else auto. On CUDA each rank takes the GPU
    of its local rank, so `nproc` above the visible GPUs is refused before any rank starts.

    With `max_restarts` K, a failure of any rank (an exception, kill -9, the OOM killer)
    makes the elastic agent stop the group and start it again, up to K times; each new
    attempt sees TORCHELASTIC_RESTART_COUNT (train_rank resumes from its last checkpoint).
    A collective that waits longer than `collective_timeout_s` fails (the watchdog then
    names the rank behind or gone)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: launch needs a whole number of ranks >= 1")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give a whole number >= 0")
    from meshtrain.core.device import check_ranks_fit, prefer_expandable_segments, resolve_device
    device = resolve_device(device)
    check_ranks_fit(device, nproc)
    prefer_expandable_segments()   # before the forkserver starts: the ranks inherit it
    ref = function_ref(fn)
    payload = pickle.dumps((tuple(args), dict(kwargs or {})))
    _quiet_elastic_logs()
    if start_method == "forkserver":
        forkserver_context()  # torch and meshtrain preloaded: ranks start in ~0.1 s
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"meshtrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
        rdzv_configs={"timeout": int(timeout_s)}, max_restarts=max_restarts,
        start_method=start_method, monitor_interval=0.05)
    with tempfile.TemporaryDirectory(prefix="meshtrain-launch-") as result_dir:
        failure = None
        try:
            elastic_launch(config, _worker)(ref, payload, result_dir, collective_timeout_s,
                                           device)
        except ChildFailedError as err:
            failure = err
        except SignalException as err:   # the agent's own handler: a traceback, not a message
            raise Interrupted(err.sigval.name) from None
        results = _read_results(Path(result_dir), nproc)
        raised = _read_raised(Path(result_dir))
        died = [rank for rank in range(nproc) if results[rank] is _MISSING
                and rank not in raised and not (Path(result_dir) / f"rank{rank}.stopped").exists()]
    if failure is None or all(r is not _MISSING for r in results):
        if failure is not None:
            warnings.warn(f"a rank ended abnormally after returning its result (the known "
                          f"gloo teardown abort); results kept:\n{_failure_text(failure)}",
                          RuntimeWarning, stacklevel=2)
        return results
    raise LaunchError(_failure_text(failure, raised), raised,
                      _culprits(failure, raised, died)) from None


_MISSING = object()


class Interrupted(KeyboardInterrupt):
    """This process was told to stop (Ctrl-C, a kill) while its ranks ran: the elastic agent
    has stopped them. A KeyboardInterrupt, so every command answers it as one."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def _read_results(folder: Path, nproc: int) -> list:
    out = []
    for rank in range(nproc):
        path = folder / f"rank{rank}.pkl"
        out.append(pickle.loads(path.read_bytes()) if path.exists() else _MISSING)
    return out


def _read_raised(folder: Path) -> dict[int, dict]:
    """What the ranks whose `fn` raised wrote (type, message, traceback), earliest first."""
    files = sorted(folder.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    return {int(f.stem[len("rank"):]): json.loads(f.read_text()) for f in files}


def _failure_text(err, raised: dict[int, dict] | None = None) -> str:
    raised = raised or {}
    lines = [f"rank {rank} failed (raised in the launched function):\n{info['traceback']}"
             for rank, info in raised.items()]
    # earliest first: a rank's error is often the echo of a peer that failed before it
    for rank, failure in sorted(err.failures.items(), key=lambda kv: kv[1].timestamp):
        if rank in raised:
            continue
        message = failure.message
        if isinstance(message, dict):  # @record's error file: {"message": ..., "extraInfo": {...}}
            info = message.get("extraInfo", {})
            message = info.get("py_callstack") or message.get("message")
        signal_name = failure.signal_name()
        why = f"signal {signal_name}" if signal_name else f"exit code {failure.exitcode}"
        lines.append(f"rank {rank} failed ({why}):\n{message}")
    return "\n".join(lines)


def _culprits(err, raised: dict[int, dict], died: list[int]) -> list[str]:
    lines = []
    for rank in died:
        failure = err.failures.get(rank)
        how = (f"signal {failure.signal_name()}" if failure and failure.signal_name() else
               f"exit code {failure.exitcode}" if failure else
               "killed or crashed: a signal such as kill -9 or the out-of-memory killer")
        lines.append(f"rank {rank} died without an error of its own ({how})")
    echo = " (likely an echo of the rank that died)" if lines else ""
    first_line = lambda text: (text.strip().splitlines() or [""])[0][:400]
    ours = ("CollectiveFailure", "CollectiveMismatch")   # already one line, naming the culprit
    said: dict[str, list[int]] = {}   # the same error on several ranks is said once
    for rank, info in raised.items():
        said.setdefault(f"{info['type']}: " + (
            info["message"] if info["type"] in ours else first_line(info["message"]) + echo),
            []).append(rank)
    return lines + [f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, sorted(ranks)))} raised "
                    f"{text}" for text, ranks in said.items()]


def _quiet_elastic_logs() -> None:
    """The elastic agent logs every rendezvous step, and each worker's failure, itself;
    `launch` reports failures in its own error, so keep only the agent's warnings."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.multiprocessing", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
