"""Load from several processes (``appliance perf --processes N``).

One Python process tops out at one core; the gRPC and MQTT clients cost 100-600 us
of CPU per request, so on a bigger machine, or against a faster server, one process
can become the bottleneck. With ``--processes N`` each of N worker processes
prepares its own transport from the same settings and carries a share of every
point: concurrency split into integer shares, a Poisson rate into equal parts. All
share one measured window (an absolute start time); the parent puts no load, reads
the server's statistics at the window's ends, merges the workers' latencies and
errors and adds up their CPU time.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

from appliance.errors import ApplianceError, Code
from appliance.perf.plan import Settings, new_loop, prepare, split_load
from appliance.perf.runner import Point, StatsReader, Window, drive, finish, make_window, observe

START_LEAD_S = 0.3  # time for every worker to receive the point before its warm-up ends


def _worker_main(conn: Connection, s: Settings, index: int) -> None:
    loop = new_loop()
    try:
        loop.run_until_complete(_worker(conn, s, index))
    finally:
        loop.close()
        conn.close()


async def _worker(conn: Connection, s: Settings, index: int) -> None:
    loop = asyncio.get_running_loop()
    try:
        samples, transport, slots = await prepare(s, None, s.processes)
        await transport.open(samples, slots)
    except Exception as exc:  # reported to the parent, which fails the run
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", ""))
    try:
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command[0] == "stop":
                return
            _, kind, value, start_at, window_s = command
            point = Point(transport.name, s.model, s.batch_size)
            if kind == "c":
                point.concurrency = int(value)
            else:
                point.request_rate = value
            window = make_window(0.0, window_s, start_at)
            if value > 0:
                cpu, _, _ = await drive(
                    transport, point, len(samples), window, None, s.max_outstanding, seed=index
                )
            else:  # no share of this point: stay idle through it
                cpu, _, _ = await observe(window, None)
            conn.send(("done", window.latencies, window.errors, cpu))
    finally:
        await transport.close()


class Fleet:
    """The worker processes of one run."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        ctx = multiprocessing.get_context("spawn")  # no copy of the parent's event loop
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(s.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, s, i), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    async def _recv(self, conn: Connection) -> Any:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, conn.poll, 120):
            raise ApplianceError(Code.UNAVAILABLE, "a load worker process stopped answering")
        try:
            return await loop.run_in_executor(None, conn.recv)
        except EOFError:
            raise ApplianceError(Code.UNAVAILABLE, "a load worker process died") from None

    async def ready(self) -> None:
        for conn in self.conns:
            status, message = await self._recv(conn)
            if status != "ready":
                raise ApplianceError(Code.UNAVAILABLE, f"load worker: {message}")

    async def measure(self, point: Point, stats: StatsReader | None, progress: Any = None) -> Point:
        kind = "c" if point.concurrency else "r"
        value = float(point.concurrency or point.request_rate)
        start_at = time.time() + max(self.s.warmup_s, START_LEAD_S)
        for conn, share in zip(self.conns, split_load(kind, value, len(self.conns)), strict=True):
            conn.send(("point", kind, share, start_at, self.s.window_s))
        window = make_window(0.0, self.s.window_s, start_at)
        _, before, after = await observe(window, stats, progress)
        cpu = 0.0
        for conn in self.conns:
            _, latencies, errors, worker_cpu = await self._recv(conn)
            window.latencies.extend(latencies)
            for k, n in errors.items():
                window.errors[k] = window.errors.get(k, 0) + n
            cpu += worker_cpu
        return finish(point, window, cpu, before, after)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


__all__ = ["Fleet", "Window"]
