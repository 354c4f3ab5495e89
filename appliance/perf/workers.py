"""Load from several processes (``appliance perf --processes N``).

One Python process tops out at one core; the gRPC and MQTT clients cost 100-600 us
of CPU per request, so on a bigger machine, or against a faster server, one process
can become the bottleneck. With ``--processes N`` each of N worker processes
prepares its own transport from the same settings and carries a share of every
point: concurrency split into integer shares, a Poisson rate into equal parts. All
share one measured window: the parent puts no load, reads the server's statistics
once the warm-up is over and then tells the workers that the window opened (an
absolute time), waits for every worker to close its window, reads the statistics
again, merges the workers' latencies and errors and adds up their CPU time.
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
from appliance.perf.runner import Point, StatsReader, drive, finish, observe
from appliance.perf.window import COUNT_WINDOW_MAX_S, Window, local_instant, make_window

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
            _, kind, value, start_at, window_s, quota = command
            point = Point(transport.name, s.model, s.batch_size)
            if kind == "c":
                point.concurrency = int(value)
            else:
                point.request_rate = value
            window = make_window(0.0, window_s, start_at, quota)
            opening = _opening(conn)
            if value > 0:
                cpu, _, _ = await drive(
                    transport, point, len(samples), window, None, s.max_outstanding,
                    seed=index, opening=opening,
                )  # fmt: skip
            else:  # no share of this point: stay idle through it
                cpu, _, _ = await observe(window, None, opening=opening)
            conn.send(("done", window.latencies, window.errors, cpu, window.seconds))
    finally:
        await transport.close()


async def _opening(conn: Connection) -> float:
    """When the parent opened the window (it read the statistics first), as this
    process's ``time.perf_counter`` reads that instant."""
    message = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    if message[0] != "open":
        raise ApplianceError(Code.INTERNAL, f"load worker: unexpected {message[0]!r}")
    return local_instant(message[1])


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

    async def _recv(self, conn: Connection, wait_s: float = 120) -> Any:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, conn.poll, wait_s):
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
        """One point: every worker warms up, the parent reads the statistics and opens
        the window (each worker closes its own: at the duration, or once its share of
        ``--measurement-request-count`` completed), then reads them again."""
        s = self.s
        kind = "c" if point.concurrency else "r"
        value = float(point.concurrency or point.request_rate)
        shares = split_load(kind, value, len(self.conns))
        active = sum(1 for share in shares if share > 0)
        quota = -(-s.min_requests // active) if active else 0  # each active worker's part
        start_at = time.time() + max(s.warmup_s, START_LEAD_S)
        for conn, share in zip(self.conns, shares, strict=True):
            conn.send(("point", kind, share, start_at, s.window_s, quota if share > 0 else 0))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        before = await stats() if stats else None
        opened = time.time()
        for conn in self.conns:
            conn.send(("open", opened))
        window = Window(0.0, s.window_s)
        nominal_end = local_instant(opened + s.window_s)
        while (left := nominal_end - time.perf_counter()) > 0:
            await asyncio.sleep(min(left, 0.5))
            if progress is not None:
                progress(1.0 - max(0.0, nominal_end - time.perf_counter()) / s.window_s)
        cpu = 0.0
        wait_s = s.window_s + COUNT_WINDOW_MAX_S + 120
        for conn in self.conns:
            _, latencies, errors, worker_cpu, seconds = await self._recv(conn, wait_s)
            window.latencies.extend(latencies)
            for k, n in errors.items():
                window.errors[k] = window.errors.get(k, 0) + n
            window.until = max(window.until, seconds)  # the longest worker's window
            cpu += worker_cpu
        after = await stats() if stats else None
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
