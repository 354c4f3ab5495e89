"""``appliance perf``: measure a KServe v2 server (this appliance or Triton).

    appliance perf -m simple -u 127.0.0.1:8000 --concurrency 1:32:2x
    appliance perf -m classifier -i grpc -b 4 --request-rate 50:200:50 --csv out.csv
    appliance perf -m image_classifier --input-data files --input-files frames/
    appliance perf --ceiling                   # the load generator's own limit

Metadata, config and statistics are read over HTTP (``-u``) for every network
transport; ``-i inprocess`` loads ``--model-repository`` into this process
instead. Exit status: 0 when every point completed requests without errors,
1 when some requests failed (the table says which), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from appliance.errors import ApplianceError, invalid
from appliance.perf import report, throttle
from appliance.perf.httpclient import Admin
from appliance.perf.plan import Settings, new_loop, plan_loads, prepare
from appliance.perf.runner import Point, StatsReader, measure, parse_range
from appliance.perf.workers import Fleet
from appliance.perf.workload import parse_shapes

__all__ = ["Settings", "new_loop", "run"]


async def run(
    s: Settings, table: report.LiveTable | None = None, server: Any = None
) -> list[Point]:
    """Measure every point of ``s``; ``server`` is a started InProcessServer for
    ``inprocess`` (one is made from ``model_repository`` when not given)."""
    own = None
    if s.transport == "inprocess" and server is None:
        from appliance.adapters.inprocess import InProcessServer  # only this transport loads models

        own = server = InProcessServer(s.model_repository)
        await own.start()
    stats_admin = Admin(s.url, s.token) if server is None else None
    scraper = None
    if server is None:
        scraper = throttle.Scraper(throttle.metrics_url(s.url, s.metrics_url))
    try:
        stats: StatsReader
        if server is not None:

            async def stats() -> dict[str, Any] | None:
                rows = server.statistics(s.model, s.version).get("model_stats") or []
                return rows[-1] if rows else None
        else:
            assert stats_admin is not None
            stats = lambda: stats_admin.stats(s.model)  # noqa: E731
        stats = throttle.with_device(stats, scraper or throttle.local(server))
        if s.processes > 1:
            return await _run_fleet(s, table, stats)
        samples, transport, slots = await prepare(s, server)
        points = []
        try:
            await transport.open(samples, slots)
            for p in _points(s, transport.name):
                await measure(
                    transport, p, len(samples), s.warmup_s, s.window_s, stats,
                    s.max_outstanding, progress=_progress(table, p), min_requests=s.min_requests,
                )  # fmt: skip
                points.append(_show(table, p))
        finally:
            await transport.close()
        return points
    finally:
        if stats_admin is not None:
            await stats_admin.close()
        if scraper is not None:
            await scraper.close()
        if own is not None:
            await own.stop()


async def _run_fleet(
    s: Settings, table: report.LiveTable | None, stats: StatsReader
) -> list[Point]:
    if s.transport == "inprocess":
        raise invalid("--processes > 1 needs a network transport (not inprocess)")
    fleet = Fleet(s)
    try:
        await fleet.ready()
        points = []
        for p in _points(s, s.transport):
            points.append(_show(table, await fleet.measure(p, stats, _progress(table, p))))
        return points
    finally:
        await asyncio.get_running_loop().run_in_executor(None, fleet.close)


def _points(s: Settings, transport: str) -> list[Point]:
    points = []
    for kind, value in plan_loads(s):
        p = Point(transport, s.model, s.batch_size)
        if kind == "c":
            p.concurrency = int(value)
        else:
            p.request_rate = value
        points.append(p)
    return points


def _progress(table: report.LiveTable | None, p: Point) -> Callable[[float], None] | None:
    if table is None:
        return None
    label = p.label
    return lambda f: table.progress(label, f)


def _show(table: report.LiveTable | None, p: Point) -> Point:
    if table is not None:
        table.row(p)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    if min(args.batch_size, args.max_outstanding, args.processes) < 1 or args.duration <= 0:
        raise invalid("-b, --duration, --max-outstanding and --processes must be > 0")
    if args.warmup < 0 or args.measurement_request_count < 0:
        raise invalid("--warmup and --measurement-request-count must be >= 0")
    if not args.model and not args.ceiling:
        raise invalid("-m/--model is required (or --ceiling)")
    return Settings(
        model=args.model or "trivial",
        url=args.url,
        transport=args.transport,
        version=args.model_version,
        grpc_url=args.grpc_url,
        mqtt_broker=args.mqtt_broker,
        mqtt_prefix=args.mqtt_prefix,
        mqtt_device=args.mqtt_device,
        model_repository=args.model_repository,
        batch_size=args.batch_size,
        concurrency=[int(c) for c in parse_range(args.concurrency)],
        request_rates=parse_range(args.request_rate, "--request-rate") if args.request_rate else [],
        warmup_s=args.warmup,
        window_s=args.duration,
        min_requests=args.measurement_request_count,
        input_data=args.input_data,
        input_files=args.input_files,
        shapes=parse_shapes(args.shape),
        token=args.token,
        max_outstanding=args.max_outstanding,
        json_data=args.json_data,
        processes=args.processes,
        metrics_url=args.metrics_url,
    )


def _trivial_server() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "appliance.perf.trivial", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        proc.wait()
        raise invalid("the trivial server for --ceiling did not start")
    return proc, f"127.0.0.1:{port}"


def main(args: argparse.Namespace) -> int:
    try:
        s = settings_from_args(args)
        if args.ceiling and s.transport != "http":
            raise invalid("--ceiling measures the HTTP client: leave -i at http")
    except ApplianceError as exc:
        print(f"appliance perf: error: {exc}", file=sys.stderr)
        return 2
    proc = None
    if args.ceiling:
        proc, s.url = _trivial_server()
    table = report.LiveTable(quiet=args.quiet)
    loop = new_loop()
    task = loop.create_task(run(s, table))
    try:
        points = loop.run_until_complete(task)
    except ApplianceError as exc:
        print(f"appliance perf: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # let the run's finally blocks close connections and remove shared memory
        task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(task)
        return 130
    finally:
        loop.close()
        if proc is not None:
            proc.terminate()
            proc.wait()
    warning = report.throttle_warning(points)
    if warning:
        print(f"appliance perf: {warning}", file=sys.stderr)
    if args.csv:
        args.csv.write_text(report.to_csv(points))
    if args.json:
        args.json.write_bytes(report.to_json(points, s.json()))
    if args.plot and not report.plot(points, args.plot, f"{s.model} over {s.transport}"):
        print("appliance perf: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
    return 1 if any(p.errors or not p.requests for p in points) else 0
