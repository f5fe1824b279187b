"""The process's peak resident memory told per phase (core/memory.py): a reset starts a new
window, and a window spanning resets (plan --verify's) still sees the highest peak."""
import sys

import pytest
import torch

from meshtrain.core.memory import (peak_mark, peak_process_bytes, peak_since,
                                   reset_process_peak, resident_bytes)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's VmHWM")

BIG = 256 << 20


def test_a_window_spanning_a_reset_keeps_the_peak_the_reset_ended():
    assert reset_process_peak()
    mark = peak_mark()
    before = resident_bytes()
    t = torch.ones(BIG // 4)   # touched: resident
    del t
    reset_process_peak()   # a phase ends (the Trainer's build, say)
    assert peak_process_bytes() < before + BIG // 2   # the new phase's window starts low
    assert peak_since(mark) >= before + BIG - (16 << 20)   # the spanning window does not


_FRAGMENT = """
import ctypes, sys
from meshtrain.core.processes import steady_host_heap  # no torch: a cheap process
if sys.argv[1] == "steady":
    assert steady_host_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

def touched(n):
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    return p

libc.free(touched(16 << 20))   # a 16 MiB block freed: the threshold rises
base = resident_bytes()
blocks = [touched(2 << 20) for _ in range(32)]   # 32 x 2 MiB, touched (tensors' buffers)
for p in blocks[:-1]:                            # all freed but the last
    libc.free(p)
print((resident_bytes() - base) >> 20)
"""


@pytest.mark.parametrize("heap", ["steady", "default"])
def test_a_steady_heap_gives_back_what_a_step_frees(heap):
    """32 blocks of 2 MiB freed but the last: from glibc's heap (its threshold raised by a
    16 MiB block freed before) the last pins the 62 MiB below it; with the threshold kept
    at 128 KiB each block is its own mapping and only the last stays resident."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _FRAGMENT, heap], capture_output=True,
                         text=True, check=True).stdout
    held_mib = int(out)
    if heap == "steady":
        assert held_mib <= 2 + 2   # the block kept, give or take a page table
    else:
        assert held_mib >= 60      # what the steady heap is for
