"""Shared fixtures: real ONNX model repositories and a real server on a free loopback port.

``run_appliance(repository, **server_options)`` starts the real :class:`Server`
in a background thread with its own event loop, bound to 127.0.0.1 on free
ports, and stops it (gracefully, as SIGTERM would) at teardown. The loop runs
in asyncio debug mode and the fixture fails the test if any one callback blocked
it: kept its thread busy for half a second of CPU time, or waited off the CPU
(sleeping, on a lock, a child process, a socket) for seconds while not waiting for a
CPU. Inference must never run on the event loop.

Not wall time: on a loaded machine (CI's two cores, a shared machine at load 18) a
trivial callback can take seconds of wall time waiting for a CPU, or for the GIL
or a lock held by a thread that waits for one. The thread's own CPU time and its
run-queue wait (``/proc/thread-self/schedstat``) tell those apart from work or a
blocking call on the loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pace import scaled
from sd_listener import Listener

from appliance.config.server_config import load_server_config
from appliance.server import Server
from devtools import modelgen

# a callback that keeps the loop's thread busy for this much CPU time fails the test (a
# request decoded or a model run on the loop); load does not inflate a thread's CPU time
# (emulation does: both limits scale with tests/pace.py)
BLOCKING_CPU_S = scaled(0.5)
# a callback that waited this long off the CPU, and not for a CPU, fails it too (a sleep,
# a lock, a child process or a socket waited on by the loop). A loaded machine makes the
# loop wait for the GIL and for locks held by threads that wait for a CPU themselves:
# seconds at most, measured up to about 1 s at load 20 here
BLOCKING_WAIT_S = scaled(5.0)


def write_test_repository(repo: Path) -> Path:
    """Models used across the end-to-end tests (all deterministic)."""
    modelgen.write_demo_repository(repo)
    for datatype in modelgen.DATATYPES:
        modelgen.write_model(
            repo, f"identity_{datatype.lower()}", modelgen.identity(datatype, [-1])
        )
    # no config at all: everything is auto-completed from the graph
    modelgen.write_model(repo, "mlp_auto", modelgen.mlp())
    modelgen.write_model(repo, "no_batch_add", modelgen.no_batch_add([4]))
    modelgen.write_model(
        repo,
        "broken_config",
        modelgen.simple_add_sub(),
        "backend: onnxruntime\nmax_batch_size: -3\n",
    )
    return repo


@pytest.fixture(scope="session")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_repository(tmp_path_factory.mktemp("repo"))


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


class _BlockingDetector:
    """Measures every callback of the loops it watches: ``asyncio.Handle._run`` (what
    asyncio's loops call to run a callback) is wrapped once for the test session, and
    the callbacks of unwatched loops pass straight through."""

    watched: dict[asyncio.AbstractEventLoop, tuple[_BlockingDetector, _ThreadClock]] = {}

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
    watching = _BlockingDetector.watched.get(handle._loop)
    if watching is None:
        _handle_run(handle)
    else:
        watching[0].run(handle, watching[1])


asyncio.events.Handle._run = _measured_run


@dataclass
class Running:
    server: Server
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's loop (e.g. a data-plane call)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.call(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


@pytest.fixture
def run_appliance() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []
    detector = _BlockingDetector()

    def start(repository: Path | None = None, **options: Any) -> Running:
        options.setdefault("http_port", 0)
        options.setdefault("metrics_port", 0)
        options.setdefault("grpc_port", 0)
        options.setdefault("drain_timeout_s", 10)
        options["model_repository"] = repository
        config = load_server_config(None, options)
        loop = asyncio.new_event_loop()
        loop.set_debug(True)  # asyncio's own checks (calls from the wrong thread, ...)
        loop.slow_callback_duration = 3600  # its wall-time warning: the detector measures
        detector.watch(loop)
        server = Server(config)
        ready = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.start())
            except BaseException as exc:  # reported to the test below
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        thread = threading.Thread(target=main, name="appliance-test-loop", daemon=True)
        thread.start()
        ready.wait(120)
        if errors:
            thread.join(30)
            detector.forget(loop, thread)
            raise errors[0]
        running = Running(server, loop, thread)
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        running.stop()
        detector.forget(running.loop, running.thread)
    assert not detector.slow, f"the event loop was blocked: {detector.slow}"


@pytest.fixture
def listener() -> Iterator[Listener]:
    """A notify socket, as systemd listens on one (tests of Type=notify units)."""
    folder = Path(tempfile.mkdtemp(prefix="sdn-", dir="/tmp"))  # a short AF_UNIX path
    listen = Listener(folder / "notify")
    yield listen
    listen.sock.close()
    shutil.rmtree(folder)
