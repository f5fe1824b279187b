"""The collective watchdog: when a collective fails or waits past the timeout, name the
culprit (which rank is behind, diverged or gone, and at which call).

Every rank logs its sequence of communication calls per axis (`CollectiveLog`: op, axis,
tag, shape, dtype, numbered per axis). A thread publishes the log's recent tail and a
heartbeat to the process group's store once a second. When a collective raises (gloo's
timeout, a peer's connection closed), `Watchdog.diagnose` reads every rank's tail twice,
a few heartbeats apart, and compares the ranks that share each axis:

- a rank whose heartbeat stopped is gone (it died or its process hangs outside Python);
- at the first call number where the members' calls differ, the rank(s) outside the
  majority diverged (skipped a call, or called another), named with both calls;
- a rank with fewer calls than the others and no difference before is behind.

Point-to-point sends and receives are logged, numbered apart, and not compared: their order
and number differ between ranks by design (pipeline schedules).

[Note: on NCCL, ours first]
gloo's collectives raise at the process group's timeout; NCCL's do not: the host only queues
them, then blocks wherever it next waits for the device (the step's loss), and torch's own
NCCL watchdog, at the group's timeout, aborts the communicators and the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING, which the elastic agent sets to 1; with
TORCH_NCCL_DUMP_ON_TIMEOUT and TORCH_NCCL_TRACE_BUFFER_SIZE it also dumps its flight
recorder), before anything of ours runs. So where the group has NCCL (`configure`), the group's
timeout is ours plus NCCL_GRACE_S, and our thread watches for a stall itself: inside a step
(`busy`), no new communication call for the collective timeout. It then diagnoses as above
and hands the message to the stall handler (the launcher's writes it as this rank's error and
ends the process), before NCCL's timeout fires.

[Note: the store outlives the ranks]
The store is the rendezvous's TCPStore (the elastic agent's, or the test harness's), so a
dead rank's last published tail remains readable: the message can say where it stopped.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict, deque
from collections import Counter

from meshtrain.core.mesh import GROUP_AXES

P2P = {"send", "recv"}
NCCL_GRACE_S = 60.0   # NCCL's timeout past ours: time to notice a stall, diagnose, report

_stall_after: float | None = None   # see [Note: on NCCL, ours first]


def configure(collective_timeout_s: float, backend: str) -> float:
    """The process group's timeout for a backend, and where it has NCCL, our stall watch:
    see [Note: on NCCL, ours first]."""
    global _stall_after
    nccl = "nccl" in backend
    _stall_after = collective_timeout_s if nccl else None
    return collective_timeout_s + NCCL_GRACE_S if nccl else collective_timeout_s


def _exit_on_stall(message: str) -> None:
    print(f"meshtrain: {message}", file=sys.stderr, flush=True)
    os._exit(1)


stall_handler = _exit_on_stall
"""Called (from the watchdog's thread) with the diagnosis of a stall; must end the process."""


def signature(op: str, axis: str, tag: str, dtype=None, shape=None) -> str:
    """One call, as it is compared between ranks: `all_reduce dp[grads] float32[4096]`."""
    where = f"{axis}[{tag}]" if tag else axis
    if dtype is None:
        return f"{op} {where}"
    return f"{op} {where} {str(dtype).removeprefix('torch.')}{list(shape)}"


class CollectiveLog:
    """This rank's communication calls, numbered per axis; keeps the last `keep` per axis,
    or every call while `record_all` is set (the --check-collectives step).

    Every communication call passes here, so `enter` only stores the call's parts; they
    become text (`signature`) when the watchdog publishes them."""

    def __init__(self, keep: int = 64) -> None:
        self.count: dict[str, int] = defaultdict(int)
        self.recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=keep))
        self.lock = threading.Lock()
        self.record_all = False
        self.all_calls: list[tuple[int, str]] = []

    def enter(self, op: str, axis: str, tag: str, tensor=None) -> None:
        call = (op, axis, tag) if tensor is None else (op, axis, tag, tensor.dtype,
                                                       tuple(tensor.shape))
        # sends and receives are numbered apart ("pp:p2p"): their counts differ between
        # ranks by design, and must not shift the numbers of the collectives compared
        key = f"{axis}:p2p" if op in P2P else axis
        with self.lock:
            self.count[key] += 1
            self.recent[key].append((self.count[key], call))
            if self.record_all and op not in P2P:
                self.all_calls.append((self.count[key], signature(*call)))

    def tail(self) -> dict[str, dict]:
        with self.lock:
            return {axis: {"count": self.count[axis],
                           "recent": [(i, signature(*call)) for i, call in self.recent[axis]]}
                    for axis in self.count}


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names the culprit and the call."""


class CollectiveStall(RuntimeError):
    """No communication call returned for the collective timeout, inside a step."""


class CollectiveMismatch(RuntimeError):
    """--check-collectives found ranks whose first-step call sequences differ."""


class Watchdog:
    """Publishes this rank's log tail to the store every `interval` seconds (a daemon
    thread), and diagnoses a failed collective from every rank's tail."""

    KEY = "meshtrain/watch/"

    def __init__(self, log: CollectiveLog, mesh, interval: float = 1.0,
                 stall_after: float | None = None) -> None:
        import torch.distributed as dist

        self.log, self.mesh, self.interval = log, mesh, interval
        self.store = dist.distributed_c10d._get_default_store()
        self.stall_after = stall_after
        """Seconds without a new call inside a step that make a stall (None: never)."""
        self.busy = False   # inside a step or an evaluation (Trainer._watched)
        self._seen = (-1, 0.0)   # (calls logged, when that count was first seen)
        self.beats = 0
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="meshtrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        self.beats += 1
        self._published = (dict(self.log.count), time.monotonic())
        self.store.set(self.KEY + str(self.mesh.rank),
                       json.dumps({"beat": self.beats, "axes": self.log.tail()}))

    def _run(self) -> None:
        # new calls are published within 50 ms (a rank that runs ahead and exits leaves its
        # true tail), an unchanged log once per interval (the heartbeat)
        while not self._stop.wait(0.05):
            counts, at = self._published
            if counts == self.log.count and time.monotonic() - at < self.interval:
                continue
            try:
                self._publish()
            except Exception:   # the store is gone: the run is ending
                return
            if self.stalled(time.monotonic()):
                stall_handler(self.diagnose(CollectiveStall(
                    f"no communication call returned for {self.stall_after:g} s inside a step "
                    "(--collective-timeout)")))
                return

    def follow(self, comm) -> None:
        """Publish `comm`'s calls from now on: the Trainer stepping (a process may hold
        several, e.g. a benchmark alternating them)."""
        self.log, self.mesh = comm.log, comm.mesh

    def stalled(self, now: float) -> bool:
        """Inside a step, the log unchanged for `stall_after` seconds (checked by the
        thread; `now` on time.monotonic)."""
        count = sum(self.log.count.values())
        if not self.busy or count != self._seen[0]:
            self._seen = (count, now)
            return False
        return self.stall_after is not None and now - self._seen[1] >= self.stall_after

    def close(self) -> None:
        self._stop.set()

    def _read(self) -> dict[int, dict]:
        states = {}
        for rank in range(self.mesh.world_size):
            key = self.KEY + str(rank)
            if self.store.check([key]):
                states[rank] = json.loads(self.store.get(key))
        return states

    def diagnose(self, error: BaseException) -> str:
        """What went wrong, in one paragraph: who is gone, behind or diverged, at which call."""
        try:
            first = self._read()
            time.sleep(2.5 * self.interval)   # a live rank beats at least twice meanwhile
            now = self._read()
        except Exception as exc:   # the store itself is unreachable
            return f"a collective failed ({_first_line(error)}); the store is unreachable " \
                   f"too ({_first_line(exc)}), so the culprit is unknown"
        gone = sorted(r for r in range(self.mesh.world_size)
                      if r != self.mesh.rank and (r not in now or
                                                  now[r]["beat"] == first.get(r, {}).get("beat")))
        findings = []
        for axis in GROUP_AXES:
            if self.mesh.size(axis) > 1:
                members = [self.mesh.global_rank(axis, i) for i in range(self.mesh.size(axis))]
                findings += compare(axis, {r: now.get(r, {}).get("axes", {}).get(axis)
                                           for r in members}, set(gone))
        for rank in gone:
            if not any(f"rank {rank} " in f for f in findings):
                findings.append(f"rank {rank} is gone (its heartbeat stopped)")
        what = "; ".join(findings) or "every rank reached the same call: the failure is not " \
                                      "a rank behind or diverged (see the error)"
        return f"a collective failed on rank {self.mesh.rank} ({_first_line(error)}): {what}"


_watchdog: Watchdog | None = None


def watch(comm) -> Watchdog | None:
    """The process's watchdog, now publishing `comm`'s log (one per process: each Trainer
    has it follow its own comm as it steps). None without a process group of several ranks."""
    import torch.distributed as dist

    global _watchdog
    if not (dist.is_available() and dist.is_initialized()) or comm.mesh.world_size == 1:
        return None
    if _watchdog is None or _watchdog.store is not dist.distributed_c10d._get_default_store():
        if _watchdog is not None:
            _watchdog.close()
        _watchdog = Watchdog(comm.log, comm.mesh, stall_after=_stall_after)
    else:
        _watchdog.follow(comm)
        _watchdog.stall_after = _stall_after
    return _watchdog


def is_communication_error(exc: BaseException) -> bool:
    """An error raised by the backend's transport (a timeout, a closed connection)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "NCCL", "Timed out", "Connection closed",
                                  "Connection reset"))


def compare(axis: str, tails: dict[int, dict | None], gone: set[int]) -> list[str]:
    """Findings about the members of one axis group, from their published tails."""
    calls = {r: {i: sig for i, sig in (t or {}).get("recent", []) if sig.split()[0] not in P2P}
             for r, t in tails.items()}
    counts = {r: (t or {}).get("count", 0) for r, t in tails.items()}
    common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
    for i in sorted(common):
        sigs = {r: calls[r][i] for r in calls}
        majority, votes = Counter(sigs.values()).most_common(1)[0]
        if votes == len(sigs):
            continue
        if votes * 2 > len(sigs):
            odd = [r for r, s in sigs.items() if s != majority]
            return [f"rank {r} diverged at call #{i} on {axis}: it called `{sigs[r]}` where the "
                    f"others called `{majority}`" + (" (and it is gone)" if r in gone else "")
                    for r in odd]
        listed = ", ".join(f"rank {r} `{s}`" for r, s in sorted(sigs.items()))
        return [f"the ranks of {axis} differ at call #{i}: {listed}"]
    most = max(counts.values())
    out = []
    for r, n in sorted(counts.items()):
        if n < most:
            last = (tails[r] or {}).get("recent", [])
            where = f"`{last[-1][1]}`" if last else "no call yet"
            state = "is gone" if r in gone else "is behind"
            out.append(f"rank {r} {state}: its last call on {axis} was #{n} ({where}), the "
                       f"others reached #{most}")
    return out


def first_difference(sequences: list[list], ranks: list[int] | None = None) -> str | None:
    """The first call where ranks' recorded sequences differ (--check-collectives), or None."""
    ranks = ranks if ranks is not None else list(range(len(sequences)))
    longest = max(len(s) for s in sequences)
    for i in range(longest):
        at = [s[i][1] if i < len(s) else "(no call)" for s in sequences]
        if len(set(at)) > 1:
            listed = ", ".join(f"rank {r} `{sig}`" for r, sig in zip(ranks, at))
            return f"call {i + 1} of the step differs: {listed}"
    return None


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text[:160]
