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
