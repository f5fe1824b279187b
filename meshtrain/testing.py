"""Run a function on N local ranks (gloo on CPU, or on CUDA) in a tenth of a second, for tests.

`run_ranks(world, fn, *args)` starts `world` processes from a forkserver that has torch and
meshtrain already imported (a world-2 start takes ~0.07 s instead of ~3 s with spawn), and
transformers' modeling stack where it is installed (~1.4 s once, not in every rank), joins
them in one gloo process group over a loopback TCPStore, runs `fn(*args)` on each and returns
the per-rank results in rank order.

Failure handling (a rank that fails must never leave the others hanging):
- a rank that raises: its traceback is reported with its rank, the others are killed;
- a rank that dies without a result (a crash, a signal): reported with its exit code;
- a rank that aborts *after* handing in its result (the known gloo teardown abort): the
  result is kept and a warning says what happened;
- nothing finished by `timeout`: every rank is killed and the laggards are named.

Arguments and results are pickled only between this process and the ranks it forks
(a multiprocessing queue): nothing read from disk or the network is unpickled here.

`fn` must be importable by name (a top-level function of an importable module): the child
imports it after taking the parent's `sys.path`, so pytest test modules work.
"""
from __future__ import annotations

import pickle
import queue as queue_module
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta

from meshtrain.core.processes import (forkserver_context, function_ref, resolve_function,
                                      threads_per_rank)


class RankError(RuntimeError):
    """A rank failed, crashed or hung; the message names the rank and says how."""


def _rank_main(ref, payload, rank, world, port, results, sys_path, timeout_s,
               collective_timeout_s, device="cpu", backend="gloo") -> None:
    import os

    import torch
    import torch.distributed as dist

    from meshtrain.core import watchdog
    from meshtrain.core.device import DEVICE_ENV

    sys.path[:] = sys_path
    torch.set_num_threads(threads_per_rank(world))
    try:
        fn = resolve_function(ref)
        args, kwargs = pickle.loads(payload)
        # where the mesh finds this rank's device (core/device.py); ranks beyond the GPUs
        # share them round-robin (the gloo tier: several ranks on one GPU)
        os.environ[DEVICE_ENV] = device
        if device == "cuda":
            os.environ["LOCAL_RANK"] = str(rank % torch.cuda.device_count())
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        timeout = watchdog.configure(collective_timeout_s or timeout_s, backend)   # NCCL: +grace
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        result = fn(*args, **kwargs)
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    # Teardown only after the result is handed in: an abort here cannot lose it.
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 60.0,
              collective_timeout: float | None = None, device: str = "cpu",
              **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world` ranks; return their results in rank order.
    The process group's own timeout is `collective_timeout` (default: `timeout`).

    `device="cpu"`: gloo ranks. `device="cuda"`: one rank per GPU over "cpu:gloo,cuda:nccl"
    where the GPUs suffice, else the ranks share the GPUs over gloo (which stages CUDA
    tensors through the host for its collectives)."""
    import torch.distributed as dist

    backend = _backend(world, device)
    ref = function_ref(fn)
    # transformers' modeling stack preloaded where it is installed (tests build its models),
    # but not beside CUDA ranks: nothing may touch CUDA in the process they are forked from
    ctx = forkserver_context(transformers=device != "cuda")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    payload = pickle.dumps((args, kwargs))
    procs = [ctx.Process(target=_rank_main, daemon=True, name=f"meshtrain-rank{r}",
                         args=(ref, payload, r, world, store.port, results, list(sys.path),
                               timeout, collective_timeout, device, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world, timeout, ref)
    finally:
        _stop(procs)
        results.close()


def _backend(world: int, device: str) -> str:
    from meshtrain.core.device import CUDA_BACKEND, gpu_count, resolve_device

    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_ranks(device={device!r}): choose cpu or cuda")
    if device == "cpu":
        return "gloo"
    gpus = gpu_count()
    resolve_device("cuda")   # a clear error where no GPU is visible
    return CUDA_BACKEND if world <= gpus else "gloo"


def _collect(procs, results, world: int, timeout: float, ref) -> list:
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(done) < world:
        try:
            rank, ok, data = results.get(timeout=0.05)
        except queue_module.Empty:
            _check_dead(procs, done)
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in done]
                raise RankError(f"{ref[1]} timed out after {timeout:.0f} s on {world} ranks: "
                                f"rank(s) {missing} never returned (a hang, e.g. mismatched "
                                f"collectives); all ranks were killed") from None
            continue
        if not ok:
            raise RankError(f"rank {rank} of {world} failed in {ref[1]}:\n{data}"
                            + _other_deaths(procs, exclude=rank))
        done[rank] = pickle.loads(data)
    _report_teardown_aborts(procs)
    return [done[r] for r in range(world)]


def _check_dead(procs, done) -> None:
    for rank, p in enumerate(procs):
        if rank not in done and p.exitcode is not None:
            raise RankError(f"rank {rank} died with {_describe_exit(p.exitcode)} before "
                            "returning a result")


def _other_deaths(procs, exclude: int, grace: float = 0.3) -> str:
    """A rank's error is often the echo of a peer that crashed: name any such peer too."""
    time.sleep(grace)
    dead = [f"rank {r} died with {_describe_exit(p.exitcode)}" for r, p in enumerate(procs)
            if r != exclude and p.exitcode not in (None, 0)]
    return ("\nmeanwhile: " + "; ".join(dead)) if dead else ""


def _report_teardown_aborts(procs, grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for rank, p in enumerate(procs):
        if p.exitcode not in (0, None):
            warnings.warn(f"rank {rank} ended with {_describe_exit(p.exitcode)} during "
                          "process-group teardown, after returning its result (a known gloo "
                          "teardown abort); its result is kept", RuntimeWarning, stacklevel=3)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
