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
blocking call on the loop (tests/loop_detector.py).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from loop_detector import BlockingDetector
from sd_listener import Listener

from appliance.config.server_config import load_server_config
from appliance.server import Server
from devtools import modelgen


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
    detector = BlockingDetector()

    def start(repository: Path | None = None, **options: Any) -> Running:
        options.setdefault("http_port", 0)
        options.setdefault("metrics_port", 0)
        options.setdefault("grpc_port", 0)
        options.setdefault("drain_timeout_s", 10)
        options["model_repository"] = repository
        # the loop the server runs on (asyncio's unless a test asks for another: uvloop)
        new_loop: Callable[[], asyncio.AbstractEventLoop] = options.pop(
            "new_loop", asyncio.new_event_loop
        )
        config = load_server_config(None, options)
        loop = new_loop()
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
