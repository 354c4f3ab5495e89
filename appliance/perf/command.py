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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError, invalid
from appliance.perf import report
from appliance.perf.httpclient import Admin, model_path
from appliance.perf.runner import Point, measure, parse_range
from appliance.perf.transports import (
    TRANSPORTS,
    GrpcTransport,
    HttpTransport,
    InProcessTransport,
    MqttTransport,
    ShmTransport,
    Transport,
)
from appliance.perf.workload import make_samples, parse_shapes, specs_from_metadata


@dataclass
class Settings:
    """Everything one ``appliance perf`` run needs (the CLI fills it; so does tune)."""

    model: str
    url: str = "127.0.0.1:8000"
    transport: str = "http"
    version: str = ""
    grpc_url: str = ""
    mqtt_broker: str = "127.0.0.1:1883"
    mqtt_prefix: str = "appliance"
    mqtt_device: str = ""
    model_repository: Path | None = None
    batch_size: int = 1
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rates: list[float] = field(default_factory=list)
    warmup_s: float = 2.0
    window_s: float = 5.0
    input_data: str = "random"
    input_files: Path | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    token: str = ""
    max_outstanding: int = 256
    samples: int = 4
    json_data: bool = False  # HTTP: tensors as JSON lists instead of the binary extension

    def json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


async def _describe(s: Settings, server: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's metadata and config, in-process or over HTTP."""
    if server is not None:
        dp = server.server.dataplane
        return dp.model_metadata(s.model, s.version), dp.model_config(s.model, s.version)
    admin = Admin(s.url, s.token)
    try:
        base = model_path(s.model, s.version)
        return await admin.get_json(base), await admin.get_json(base + "/config")
    finally:
        await admin.close()


def _transport(s: Settings, outputs: Any, server: Any) -> Transport:
    if s.json_data and s.transport != "http":
        raise invalid("--json-data works with -i http only")
    if s.transport == "http":
        return HttpTransport(s.url, s.model, s.version, s.token, s.json_data)
    if s.transport == "shm":
        return ShmTransport(s.url, s.model, outputs, version=s.version, token=s.token)
    if s.transport == "grpc":
        host = s.url.removeprefix("http://").rpartition(":")[0] or "127.0.0.1"
        return GrpcTransport(s.grpc_url or f"{host}:8001", s.model, s.version, s.token)
    if s.transport == "mqtt":
        if not s.mqtt_device:
            raise invalid("--transport mqtt needs --mqtt-device (the appliance's device_id)")
        return MqttTransport(s.mqtt_broker, s.model, s.mqtt_prefix, s.mqtt_device)
    if s.transport == "inprocess":
        return InProcessTransport(server, s.model, s.version)
    raise invalid(f"--transport {s.transport!r}: choose one of {', '.join(TRANSPORTS)}")


async def run(
    s: Settings, table: report.LiveTable | None = None, server: Any = None
) -> list[Point]:
    """Measure every point of ``s``; ``server`` is a started InProcessServer for
    ``inprocess`` (one is made from ``model_repository`` when not given)."""
    own = None
    if s.transport == "inprocess" and server is None:
        from appliance.inprocess import InProcessServer  # only this transport loads models

        own = server = InProcessServer(s.model_repository)
        await own.start()
    try:
        metadata, config = await _describe(s, server)
        batched = int(config.get("max_batch_size", 0) or 0) > 0
        if not batched and s.batch_size != 1:
            raise invalid(f"model '{s.model}' does not batch (max_batch_size 0): use -b 1")
        inputs = specs_from_metadata(metadata, "inputs", s.batch_size, batched, s.shapes)
        outputs = specs_from_metadata(metadata, "outputs", s.batch_size, batched, s.shapes)
        samples = make_samples(inputs, s.input_data, s.input_files, s.samples)
        loads = [("c", float(c)) for c in s.concurrency] if not s.request_rates else []
        loads += [("r", r) for r in s.request_rates]
        # one connection / shared-memory output slice per request that can be outstanding
        slots = max(
            [int(v) for k, v in loads if k == "c"]
            + [s.max_outstanding for k, _ in loads if k == "r"]
        )
        transport = _transport(s, outputs, server)
        stats_admin = Admin(s.url, s.token) if server is None else None
        stats: Callable[[], Any]
        if server is not None:

            async def stats() -> dict[str, Any] | None:
                rows = server.statistics(s.model, s.version).get("model_stats") or []
                return rows[-1] if rows else None
        else:
            assert stats_admin is not None
            stats = lambda: stats_admin.stats(s.model)  # noqa: E731
        points = []
        try:
            await transport.open(samples, slots)
            for kind, value in loads:
                p = Point(transport.name, s.model, s.batch_size)
                if kind == "c":
                    p.concurrency = int(value)
                else:
                    p.request_rate = value
                label = p.label

                def show(f: float, label: str = label) -> None:
                    if table is not None:
                        table.progress(label, f)

                await measure(
                    transport, p, len(samples), s.warmup_s, s.window_s, stats,
                    s.max_outstanding, progress=show,
                )  # fmt: skip
                if table is not None:
                    table.row(p)
                points.append(p)
        finally:
            await transport.close()
            if stats_admin is not None:
                await stats_admin.close()
        return points
    finally:
        if own is not None:
            await own.stop()


def add_parser(sub: Any) -> None:
    """Register ``perf`` on the ``appliance`` command's subparsers."""
    p = sub.add_parser("perf", help="measure throughput and latency of a KServe v2 server")
    p.add_argument("-m", "--model", help="model name (default with --ceiling: trivial)")
    p.add_argument("-x", "--model-version", default="", help="version (default: the server's)")
    p.add_argument("-u", "--url", default="127.0.0.1:8000", help="HTTP host:port")
    p.add_argument("-i", "--transport", choices=TRANSPORTS, default="http")
    p.add_argument("--grpc-url", default="", help="gRPC host:port (default: -u's host, 8001)")
    p.add_argument("--mqtt-broker", default="127.0.0.1:1883", help="MQTT broker host:port")
    p.add_argument("--mqtt-prefix", default="appliance", help="the appliance's topic prefix")
    p.add_argument("--mqtt-device", default="", help="the appliance's MQTT device id")
    p.add_argument("--model-repository", type=Path, help="-i inprocess: repository to load")
    p.add_argument("-b", "--batch-size", type=int, default=1)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1", help="closed loop: N, a,b, a:b:step, a:b:2x")
    load.add_argument("--request-rate", help="open loop (Poisson), requests/s: same syntax")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each window")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--input-data", choices=("random", "zeros", "files"), default="random")
    p.add_argument("--input-files", type=Path, help="file or folder for --input-data files")
    p.add_argument("--json-data", action="store_true", help="-i http: send JSON, not binary")
    p.add_argument("--shape", action="append", default=[], help="NAME:d1,d2 (no batch dim)")
    p.add_argument("--token", default="", help="bearer token for the server")
    p.add_argument("--max-outstanding", type=int, default=256, help="open loop: cap")
    p.add_argument("--csv", type=Path, help="write the points as CSV")
    p.add_argument("--json", type=Path, help="write settings, machine and points as JSON")
    p.add_argument("--plot", type=Path, help="latency-throughput PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no live table")
    p.add_argument("--ceiling", action="store_true", help="measure the load generator itself")


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.batch_size < 1 or args.duration <= 0 or args.warmup < 0 or args.max_outstanding < 1:
        raise invalid("-b, --duration and --max-outstanding must be > 0, --warmup >= 0")
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
        input_data=args.input_data,
        input_files=args.input_files,
        shapes=parse_shapes(args.shape),
        token=args.token,
        max_outstanding=args.max_outstanding,
        json_data=args.json_data,
    )


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed: the client's per-request cost is part of the ceiling."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


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
    if args.csv:
        args.csv.write_text(report.to_csv(points))
    if args.json:
        args.json.write_bytes(report.to_json(points, s.json()))
    if args.plot and not report.plot(points, args.plot, f"{s.model} over {s.transport}"):
        print("appliance perf: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
    return 1 if any(p.errors or not p.requests for p in points) else 0
