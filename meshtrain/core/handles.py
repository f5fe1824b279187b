"""Work handles of collectives as meshtrain runs them: one with nothing to do (a group of
one), and one whose result needs a local step once it arrives (a reduce-scatter run as an
all-to-all sums what it received; a staging buffer is let go)."""
from __future__ import annotations


class Done:
    """Handle of a collective that had nothing to do (a group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Then:
    """Handle of a collective whose result needs one more local step once it arrives."""

    def __init__(self, work, then) -> None:
        self.work, self.then, self.done = work, then, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout=timeout)
            self.then()
            self.done = True
        return True

    def is_completed(self) -> bool:
        if not self.done and self.work.is_completed():
            self.wait()
        return self.done


class Gauge:
    """Bytes of a kind of buffer alive now, and the most at once (a high-water mark)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes
