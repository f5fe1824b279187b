"""The watchdog on NCCL, checked on CPU: NCCL's collectives never raise in the host, and
torch's NCCL watchdog aborts the process at the group's timeout. So on a group with NCCL the
timeout is ours plus a grace, and our thread notices a stall (inside a step, no new call for
our timeout), diagnoses it and hands the message on first (core/watchdog.py)."""
import json
import time

import torch.distributed as dist

from meshtrain.core import watchdog as wd


def test_nccl_gets_a_later_timeout_and_a_stall_watch():
    assert wd.configure(300.0, "gloo") == 300.0 and wd._stall_after is None
    assert wd.configure(300.0, "cpu:gloo,cuda:nccl") == 300.0 + wd.NCCL_GRACE_S
    assert wd._stall_after == 300.0
    wd.configure(300.0, "gloo")


class Store:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class Mesh:   # two ranks along dp
    rank, world_size = 0, 2

    def size(self, axis):
        return 2 if axis == "dp" else 1

    def global_rank(self, axis, i):
        return i


def test_a_stall_inside_a_step_is_diagnosed_and_handed_on(monkeypatch):
    store = Store()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    said = []
    monkeypatch.setattr(wd, "stall_handler", said.append)
    log = wd.CollectiveLog()
    for _ in range(5):
        log.enter("all_reduce", "dp", "grad")
    # rank 1 reached call #3, then stopped (its heartbeat never moves)
    store.set(wd.Watchdog.KEY + "1", json.dumps({"beat": 7, "axes": {"dp": {
        "count": 3, "recent": [[3, "all_reduce dp[grad]"]]}}}))
    dog = wd.Watchdog(log, Mesh(), interval=0.02, stall_after=0.1)
    try:
        # not inside a step, idle is no stall: 16 heartbeats, 0.02 s apart on the thread's
        # own clock, span 0.3 s, three times stall_after
        while dog.beats < 16 and dog._thread.is_alive():
            time.sleep(0.01)
        assert said == []
        dog.busy = True
        # named within stall_after / interval = 5 beats of the thread's own clock (x10),
        # however slowly the machine runs it
        beats = dog.beats
        while not said and dog.beats < beats + 50 and dog._thread.is_alive():
            time.sleep(0.01)
    finally:
        dog.close()
    assert len(said) == 1
    assert said[0].startswith("a collective failed on rank 0 (no communication call returned "
                              "for 0.1 s inside a step")
    assert "rank 1 is gone: its last call on dp was #3 (`all_reduce dp[grad]`), the others " \
           "reached #5" in said[0]


def test_calls_that_keep_coming_are_no_stall():
    log = wd.CollectiveLog()
    dog = object.__new__(wd.Watchdog)   # the arithmetic alone, without a thread or a store
    dog.log, dog.busy, dog.stall_after, dog._seen = log, True, 1.0, (-1, 0.0)
    assert not dog.stalled(0.0)
    assert not dog.stalled(0.9)
    assert dog.stalled(1.0)               # unchanged for 1 s
    log.enter("all_reduce", "dp", "grad")
    assert not dog.stalled(1.5)           # a new call: the clock starts again
    assert not dog.stalled(2.4) and dog.stalled(2.5)
    dog.busy = False
    assert not dog.stalled(9.0)
