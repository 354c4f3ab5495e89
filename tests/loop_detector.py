"""The event-loop detector the ``run_appliance`` fixture (tests/conftest.py) watches its
server's loop with: work and blocking calls on the loop fail a test; a loop merely late
on a loaded machine does not (it waited for a CPU, or for the GIL or a lock held by a
thread that waits for one). The thread's own CPU time and its run-queue wait
(``/proc/thread-self/schedstat``) tell those apart from work or a blocking call on the
loop, not wall time. A module of its own (not conftest.py) so that its test imports it
under one name, whichever conftest.py pytest imported last.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from pace import scaled

# a callback that keeps the loop's thread busy for this much CPU time fails the test (a
# request decoded or a model run on the loop); load does not inflate a thread's CPU time
# (emulation does: both limits scale with tests/pace.py)
BLOCKING_CPU_S = scaled(0.5)
# a callback that waited this long off the CPU, and not for a CPU, fails it too (a sleep,
# a lock, a child process or a socket waited on by the loop). A loaded machine makes the
# loop wait for the GIL and for locks held by threads that wait for a CPU themselves:
# seconds at most, measured up to about 1 s at load 20 here
BLOCKING_WAIT_S = scaled(5.0)


class _ThreadClock:
    """A loop thread's (CPU seconds, seconds spent waiting for a CPU), from
    ``/proc/thread-self/schedstat`` opened on that thread; where the kernel keeps no such
    file, CPU time alone (the run-queue wait reads 0, so only the CPU criterion holds)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._opened = False

    def read(self) -> tuple[float, float]:
        if not self._opened:
            self._opened = True
            try:
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                self._fd = None
        if self._fd is None:
            return time.thread_time(), 0.0
        cpu_ns, wait_ns = os.pread(self._fd, 128, 0).split()[:2]
        return int(cpu_ns) / 1e9, int(wait_ns) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class BlockingDetector:
    """Measures every callback of the loops it watches: ``asyncio.Handle._run`` (what
    asyncio's loops call to run a callback) is wrapped once for the test session, and
    the callbacks of unwatched loops pass straight through."""

    watched: dict[asyncio.AbstractEventLoop, tuple[BlockingDetector, _ThreadClock]] = {}

    def __init__(self, cpu_s: float = BLOCKING_CPU_S, wait_s: float = BLOCKING_WAIT_S) -> None:
        self.cpu_s, self.wait_s = cpu_s, wait_s
        self.slow: list[str] = []

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.watched[loop] = (self, _ThreadClock())

    def forget(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        _, clock = self.watched.pop(loop, (None, None))
        if clock is not None and not thread.is_alive():  # (else it may be reading still)
            clock.close()

    def verdict(self, wall: float, cpu: float, waited: float) -> str:
        """Why a callback of ``wall`` seconds, ``cpu`` of them on the CPU and ``waited``
        waiting for one, blocked the loop ("" if it did not)."""
        blocked = wall - cpu - waited
        if cpu < self.cpu_s and blocked < self.wait_s:
            return ""
        return (
            f"{wall:.2f} s, of which {cpu:.2f} s on the CPU, {waited:.2f} s waiting for a "
            f"CPU, {blocked:.2f} s blocked"
        )

    def run(self, handle: asyncio.Handle, clock: _ThreadClock) -> None:
        wall0 = time.monotonic()
        cpu0, waited0 = clock.read()
        try:
            _handle_run(handle)
        finally:
            wall = time.monotonic() - wall0
            if wall >= min(self.cpu_s, self.wait_s):  # (cheap: most callbacks end here)
                cpu1, waited1 = clock.read()
                why = self.verdict(wall, cpu1 - cpu0, waited1 - waited0)
                if why:
                    self.slow.append(f"{handle!r}: {why}")


_handle_run = asyncio.events.Handle._run


def _measured_run(handle: asyncio.Handle) -> None:
    watching = BlockingDetector.watched.get(handle._loop)
    if watching is None:
        _handle_run(handle)
    else:
        watching[0].run(handle, watching[1])


asyncio.events.Handle._run = _measured_run
