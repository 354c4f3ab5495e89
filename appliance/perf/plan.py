"""What one ``appliance perf`` run is: its settings, and the prepared transport.

Shared by the command (:mod:`appliance.perf.command`) and its load-generating worker
processes (:mod:`appliance.perf.workers`), which each prepare their own transport
from the same settings (same seed, so the same samples).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.cli_commands import TRANSPORTS
from appliance.errors import invalid
from appliance.perf.httpclient import Admin, model_path
from appliance.perf.transports import (
    GrpcTransport,
    HttpTransport,
    InProcessTransport,
    MqttTransport,
    Samples,
    ShmTransport,
    Transport,
)
from appliance.perf.workload import make_samples, specs_from_metadata


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
    min_requests: int = 0  # the window lasts until that many requests sent in it completed
    input_data: str = "random"
    input_files: Path | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    token: str = ""
    max_outstanding: int = 256
    samples: int = 4
    json_data: bool = False  # HTTP: tensors as JSON lists instead of the binary extension
    processes: int = 1  # load-generating processes (appliance.perf.workers)
    metrics_url: str = ""  # the server's metrics (device telemetry); default -u's host:8002

    def json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


async def describe(s: Settings, server: Any) -> tuple[dict[str, Any], dict[str, Any]]:
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


def make_transport(s: Settings, outputs: Any, server: Any) -> Transport:
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


def plan_loads(s: Settings) -> list[tuple[str, float]]:
    """The points in order: ("c", concurrency) or ("r", requests per second)."""
    loads = [("c", float(c)) for c in s.concurrency] if not s.request_rates else []
    return loads + [("r", r) for r in s.request_rates]


def split_load(kind: str, value: float, parts: int) -> list[float]:
    """A point's load over ``parts`` processes: concurrency as even integer shares
    (processes without a share get none), a Poisson rate in equal parts (the sum of
    independent Poisson processes is one of the total rate)."""
    if kind == "r":
        return [value / parts] * parts
    whole, rest = divmod(int(value), parts)
    return [float(whole + (1 if i < rest else 0)) for i in range(parts)]


async def prepare(
    s: Settings, server: Any = None, parts: int = 1
) -> tuple[Samples, Transport, int]:
    """Samples, a transport to open with them, and its slots (``parts``: processes
    sharing the load)."""
    metadata, config = await describe(s, server)
    batched = int(config.get("max_batch_size", 0) or 0) > 0
    if not batched and s.batch_size != 1:
        raise invalid(f"model '{s.model}' does not batch (max_batch_size 0): use -b 1")
    inputs = specs_from_metadata(metadata, "inputs", s.batch_size, batched, s.shapes)
    outputs = specs_from_metadata(metadata, "outputs", s.batch_size, batched, s.shapes)
    samples = make_samples(inputs, s.input_data, s.input_files, s.samples)
    # one connection / shared-memory output slice per request that can be outstanding
    slots = max(
        [int(split_load(k, v, parts)[0]) for k, v in plan_loads(s) if k == "c"]
        + [s.max_outstanding for k, _ in plan_loads(s) if k == "r"]
    )
    slots = max(slots, 1)
    return samples, make_transport(s, outputs, server), slots


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed: the client's per-request cost is part of the ceiling."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
