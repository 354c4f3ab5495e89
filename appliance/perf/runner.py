"""The measuring loop of ``appliance perf``: load points, windows and their results.

A point is either closed-loop (``concurrency`` requests always outstanding, each
reply sends the next) or open-loop (requests arrive at ``rate`` per second with
exponential gaps, i.e. a Poisson process, whatever the replies do). Each point
runs a warm-up, then a measured window (:mod:`appliance.perf.window`: of fixed
length, or until enough requests completed): a request counts if it
completes inside the window; its latency is taken from its send time (closed
loop) or from its scheduled arrival (open loop, so a late client is not hidden:
no coordinated omission). Open-loop requests beyond ``max_outstanding`` are not
sent and are counted as errors of kind ``client: outstanding limit``.

Around the window the server's statistics are read (the window opens once the
first read is in, and the second follows its close); their difference gives the
server-side queue and compute time per request. The device's telemetry is read with
them (``perf/throttle``): a point during which the device throttled says so. The
process's own CPU time over the window is reported too (client CPU per request):
with the ceiling run (``--ceiling``) it says whether the load generator could be the
bottleneck.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.errors import invalid
from appliance.perf.httpclient import RequestFailed
from appliance.perf.transports import Transport
from appliance.perf.window import Window, make_window
from appliance.telemetry import summary

StatsReader = Callable[[], Awaitable[dict[str, Any] | None]]
STAT_KEYS = ("queue", "compute_input", "compute_infer", "compute_output")


def parse_range(text: str, what: str = "--concurrency") -> list[float]:
    """``8``, ``1,4,8``, ``a:b`` (step 1), ``a:b:step`` or ``a:b:Nx`` (multiply by N)."""
    text = text.strip()
    try:
        if "," in text:
            values = [float(v) for v in text.split(",")]
        elif ":" in text:
            parts = text.split(":")
            if len(parts) not in (2, 3):
                raise ValueError
            lo, hi = float(parts[0]), float(parts[1])
            step = parts[2] if len(parts) == 3 else "1"
            values = []
            v = lo
            if step.endswith("x"):
                factor = float(step[:-1])
                if factor <= 1:
                    raise ValueError
                while v <= hi * (1 + 1e-9):
                    values.append(v)
                    v *= factor
            else:
                inc = float(step)
                if inc <= 0:
                    raise ValueError
                while v <= hi + 1e-9:
                    values.append(v)
                    v += inc
            if values and values[-1] < hi * (1 - 1e-9):
                values.append(hi)  # the end of the range is always measured
        else:
            values = [float(text)]
    except ValueError:
        values = []
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise invalid(f"{what} {text!r}: expected N, a,b,c, a:b, a:b:step or a:b:Nx (all > 0)")
    return values


@dataclass
class Point:
    """The result of one load point (one row of the table, CSV and JSON)."""

    transport: str
    model: str
    batch_size: int
    concurrency: int = 0  # closed loop; 0 for open loop
    request_rate: float = 0.0  # open loop; 0 for closed loop
    window_s: float = 0.0
    requests: int = 0  # completed successfully inside the window
    errors: int = 0
    throughput_infer_s: float = 0.0  # rows per second (requests x batch size)
    throughput_req_s: float = 0.0
    avg_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    client_cpu_us_per_req: float = 0.0
    # server side, microseconds per request, from the statistics extension
    server_requests: int = 0
    server_queue_us: float = 0.0
    server_compute_input_us: float = 0.0
    server_compute_infer_us: float = 0.0
    server_compute_output_us: float = 0.0
    server_avg_batch: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    # the device during the window (appliance.perf.throttle): None when not known
    throttled: bool | None = None
    throttle_events: int = 0
    throttle_reasons: str = ""
    max_temp_celsius: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"r={self.request_rate:g}/s"


_NUMBERS = re.compile(r"\d+")


def _kind(exc: BaseException) -> str:
    if isinstance(exc, RequestFailed):
        return exc.kind
    # numbers (ids, sizes) would split one error into many kinds
    return _NUMBERS.sub("N", f"client: {type(exc).__name__}: {exc}")[:120]


async def _closed(
    transport: Transport, concurrency: int, samples: int, window: Window, stop: asyncio.Event
) -> None:
    async def worker(slot: int) -> None:
        i = slot
        clock = time.perf_counter
        while not stop.is_set():
            began = clock()
            try:
                await transport.infer(i % samples, slot)
            except Exception as exc:  # counted by kind; the load goes on
                window.failed(_kind(exc), clock(), began)
                await asyncio.sleep(0.001)  # a refusing server must not spin the client
            else:
                window.done(began, clock())
            i += 1

    await asyncio.gather(*(worker(s) for s in range(concurrency)))


async def _open(
    transport: Transport,
    rate: float,
    max_outstanding: int,
    samples: int,
    window: Window,
    stop: asyncio.Event,
    seed: int,
) -> None:
    free = list(range(max_outstanding))
    tasks: set[asyncio.Task[None]] = set()
    rng = random.Random(seed)
    clock = time.perf_counter

    async def one(i: int, slot: int, arrival: float) -> None:
        try:
            await transport.infer(i % samples, slot)
        except Exception as exc:  # counted by kind
            window.failed(_kind(exc), clock(), arrival)
        else:
            window.done(arrival, clock())
        finally:
            free.append(slot)

    arrival = clock()
    i = 0
    while not stop.is_set():
        arrival += rng.expovariate(rate)
        delay = arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if not free:
            window.failed("client: outstanding limit", clock())
            continue
        task = asyncio.create_task(one(i, free.pop(), arrival))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def _server_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, p: Point) -> None:
    if not before or not after:
        return
    b, a = before.get("inference_stats", {}), after.get("inference_stats", {})
    n = int(a.get("success", {}).get("count", 0)) - int(b.get("success", {}).get("count", 0))
    p.server_requests = n
    if n <= 0:
        return
    for key in STAT_KEYS:
        ns = int(a.get(key, {}).get("ns", 0)) - int(b.get(key, {}).get("ns", 0))
        setattr(p, f"server_{key}_us", ns / n / 1000)
    rows = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    calls = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    p.server_avg_batch = rows / calls if calls > 0 else 0.0


def _device_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, p: Point) -> None:
    old = (before or {}).get("device")
    new = (after or {}).get("device")
    if not old or not new:  # no telemetry (or none could be read): unknown
        return
    p.throttle_events, why = summary.throttled(old, new)
    p.throttled = bool(why)
    p.throttle_reasons = "; ".join(why)
    p.max_temp_celsius = summary.hottest(new)


def _finish(p: Point, window: Window, cpu_s: float) -> None:
    lat = np.asarray(window.latencies, dtype=np.float64) * 1000
    p.requests = int(lat.size)
    p.errors = sum(window.errors.values())
    p.errors_by_kind = dict(sorted(window.errors.items(), key=lambda kv: -kv[1]))
    p.throughput_req_s = p.requests / p.window_s
    p.throughput_infer_s = p.throughput_req_s * p.batch_size
    done = p.requests + p.errors
    p.client_cpu_us_per_req = cpu_s * 1e6 / done if done else 0.0
    if lat.size:
        p.avg_ms = float(lat.mean())
        p.p50_ms, p.p90_ms, p.p95_ms, p.p99_ms = (
            float(v) for v in np.percentile(lat, [50, 90, 95, 99])
        )
        p.max_ms = float(lat.max())


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def drive(
    transport: Transport,
    point: Point,
    samples: int,
    window: Window,
    stats: StatsReader | None = None,
    max_outstanding: int = 256,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    opening: Awaitable[float] | None = None,
) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """Put ``point``'s load on ``transport`` until the window closes; returns the
    process's CPU seconds over the window and the statistics at its start and end
    (``opening``: see :func:`observe`)."""
    stop = asyncio.Event()
    if point.concurrency:
        load = _closed(transport, point.concurrency, samples, window, stop)
    else:
        load = _open(transport, point.request_rate, max_outstanding, samples, window, stop, seed)
    task = asyncio.create_task(load)
    try:
        cpu, before, after = await observe(window, stats, progress, task, opening)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 60)
        except asyncio.TimeoutError:
            window.errors["client: replies never came"] = 1
    return cpu, before, after


async def observe(
    window: Window,
    stats: StatsReader | None,
    progress: Callable[[float], None] | None = None,
    task: asyncio.Task[None] | None = None,
    opening: Awaitable[float] | None = None,
) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """Wait through the window reading the statistics at both ends (and this
    process's CPU time); ``task``: the load, whose crash ends the wait.

    The window opens once the statistics at its start are in; ``opening`` instead: it
    opens at the ``time.perf_counter`` instant that awaitable gives (a worker process
    told by its parent)."""
    before = None
    if opening is None:
        await _sleep_until(window.opens_at, task, None)
        before = await stats() if stats else None
        opened = time.perf_counter()
    else:
        opened = await _first(opening, task)
    window.open(opened)
    cpu0 = _cpu()
    await _sleep_until(window.end, task, progress)
    while (left := window.until - time.perf_counter()) > 0:  # a counting window's wait
        if task is not None and task.done():
            task.result()  # a crashed load loop: report it
            break
        await asyncio.sleep(min(left, 0.01))
    cpu1 = _cpu()
    after = await stats() if stats else None
    return cpu1 - cpu0, before, after


async def _first(opening: Awaitable[float], task: asyncio.Task[None] | None) -> float:
    """``opening``'s result, unless the load crashes first (its error is raised)."""
    waiting = asyncio.ensure_future(opening)
    if task is not None:
        await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not waiting.done():
            waiting.cancel()
            task.result()  # a crashed load loop: report it, do not measure nothing
            raise RuntimeError("the load stopped before the window opened")
    return await waiting


def finish(
    point: Point,
    window: Window,
    cpu_s: float,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> Point:
    """Fill in ``point`` from a closed window (latencies, errors) and the statistics."""
    point.window_s = window.seconds
    _server_delta(before, after, point)
    _device_delta(before, after, point)
    _finish(point, window, cpu_s)
    return point


async def measure(
    transport: Transport,
    point: Point,
    samples: int,
    warmup_s: float,
    window_s: float,
    stats: StatsReader | None = None,
    max_outstanding: int = 256,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    min_requests: int = 0,
) -> Point:
    """Run one load point against an opened transport and fill in ``point``;
    ``min_requests``: the window lasts until that many sent inside it completed."""
    window = make_window(warmup_s, window_s, min_fresh=min_requests)
    cpu, before, after = await drive(
        transport, point, samples, window, stats, max_outstanding, seed, progress
    )
    return finish(point, window, cpu, before, after)


async def _sleep_until(
    deadline: float,
    task: asyncio.Task[None] | None,
    progress: Callable[[float], None] | None,
) -> None:
    start = time.perf_counter()
    while (left := deadline - time.perf_counter()) > 0:
        if task is not None and task.done():
            task.result()  # a crashed load loop: report it, do not measure nothing
            return
        await asyncio.sleep(min(left, 0.5))
        if progress is not None and deadline > start:
            progress(min(1.0, (time.perf_counter() - start) / (deadline - start)))
