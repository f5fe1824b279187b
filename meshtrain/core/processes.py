"""What starting rank processes needs, shared by `meshtrain.launch` and `meshtrain.testing`.

- A function travels to a rank by name (module, qualified name), never pickled by value:
  the child imports it, so it must be a top-level function of a module or of the script.
- Ranks start from a forkserver that has torch and meshtrain already imported
  (`meshtrain._preload`): a world-2 start takes ~0.07 s instead of ~3 s with spawn.
  Ranks that build transformers models find its modeling stack imported there too
  (`meshtrain._preload_transformers`) where the launcher asks for it.
- Each rank gets cores / ranks threads: oversubscribing the cores costs ~2x.
- A rank of a memory-bound plan keeps its host heap steady (`steady_host_heap`).
"""
from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import sys
import time


def threads_per_rank(world: int) -> int:
    """One rank per core at most: ranks x threads <= cores (oversubscribing costs ~2x)."""
    return max(1, (os.cpu_count() or 1) // world)


QUIET_TRACKER = "ignore:resource_tracker:UserWarning"
"""A rank killed (kill -9, the launcher stopping a failed group) cannot release the
semaphores it holds; multiprocessing's resource tracker releases them and warns of each
"leak" below the failure's own message: a warning with nothing to act on."""


@functools.lru_cache(maxsize=2)
def forkserver_context(transformers: bool = False):
    """The multiprocessing context whose forkserver preloads torch and meshtrain (once), and
    with `transformers` its modeling stack too (`meshtrain._preload_transformers`), for ranks
    that build its models. The forkserver is one per process: the preload set when it starts
    is the one it keeps."""
    ctx = mp.get_context("forkserver")
    if QUIET_TRACKER not in sys.warnoptions:   # read when the resource tracker is started
        sys.warnoptions.append(QUIET_TRACKER)
    extra = ["meshtrain._preload_transformers"] if transformers else []
    ctx.set_forkserver_preload(["meshtrain._preload", *extra])
    return ctx


def process_start_time() -> float:
    """When this process started (seconds since the epoch): from /proc on Linux, else now."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + started_ticks / os.sysconf("SC_CLK_TCK")


def start_forkserver(transformers: bool = False) -> None:
    """Start the preloaded forkserver now, without waiting for it: it imports torch and
    meshtrain (and transformers, see `forkserver_context`) while this process goes on with
    its own start (a command that will launch ranks calls this first)."""
    from multiprocessing import forkserver

    forkserver_context(transformers)
    forkserver.ensure_running()


def function_ref(fn) -> tuple[str, str]:
    """(module, qualified name) by which a child process can import `fn` (given as a
    function, or already as that pair, which spares importing its module here)."""
    if isinstance(fn, tuple):
        return fn
    module, qualname = fn.__module__, fn.__qualname__
    # A script's own functions work: multiprocessing re-runs the script as the child's
    # __main__ (so its launching code must sit under `if __name__ == "__main__":`).
    from_script = module != "__main__" or getattr(sys.modules["__main__"], "__file__", None)
    if not from_script or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{qualname} cannot run on other ranks: pass a top-level function "
                         "of a module or script (not a lambda, a closure, or a function "
                         "typed into an interactive session)")
    return module, qualname


def resolve_function(ref: tuple[str, str]):
    """Import the function `function_ref` named."""
    obj = importlib.import_module(ref[0])
    for part in ref[1].split("."):
        obj = getattr(obj, part)
    return obj


# glibc's malloc serves a request above its mmap threshold with a mapping of its own, given
# back to the system on free; below it, from heaps that keep what is freed. The threshold
# starts at 128 KiB and rises to the size of each large block freed (up to 32 MiB), so after
# a step a rank's activations and buffers come from heaps whose freed gaps stay resident:
# a 30-layer Llama under ZeRO-3 over 8 CPU ranks peaked 70-313 MiB above what it held,
# 21-28 MiB with the threshold kept at 128 KiB. Each large tensor then costs fresh pages:
# a small GPT's step took ~1.4x as long, so only memory-bound plans ask for it.
HOST_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3   # mallopt's parameter number (malloc.h)


def steady_host_heap() -> bool:
    """Keep glibc's mmap threshold fixed at its starting value, so that what a step frees
    goes back to the system and the process peak stays near what the rank holds. False
    where the C library has no such setting (not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) == 1
