"""Did the device throttle while ``appliance perf`` measured it?

Around each measured window perf reads the device's telemetry next to the server's
statistics: from the server's ``/metrics`` (the appliance's ``appliance_throttle_*``,
``appliance_temperature_*`` and ``appliance_gpu_throttle_active`` families; the
metrics port is ``-u``'s host on 8002 unless ``--metrics-url`` says otherwise), or,
for ``-i inprocess``, from this process's own reading. A point throttled when a
throttle counter went up during the window, a sensor ended it at its throttle trip
point, or NVML held a GPU's clocks down; a server without telemetry (Triton, a PC
without sensors) leaves the answer unknown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from appliance.errors import ApplianceError
from appliance.perf.httpclient import Admin, split_url
from appliance.perf.runner import StatsReader
from appliance.telemetry import families as f
from appliance.telemetry.summary import from_exposed

DeviceReader = Callable[[], Awaitable[list[f.Sample] | None]]
METRICS_PORT = 8002
TIMEOUT_S = 2.0


def parse(text: str) -> list[f.Sample]:
    """The telemetry samples of a Prometheus text page."""
    out = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("appliance_"):
            continue
        for sample in family.samples:
            row = from_exposed(sample.name, sample.labels, float(sample.value))
            if row is not None:
                out.append(row)
    return out


def metrics_url(url: str, given: str) -> str:
    """``--metrics-url`` or, by default, the HTTP URL's host on port 8002."""
    if given:
        return given
    host, _ = split_url(url, 8000)
    return f"{host}:{METRICS_PORT}"


class Scraper:
    """Reads the telemetry families from a server's metrics endpoint."""

    def __init__(self, url: str) -> None:
        self.admin = Admin(url.removesuffix("/metrics"))

    async def __call__(self) -> list[f.Sample] | None:
        try:
            status, body = await asyncio.wait_for(self.admin.call("GET", "/metrics"), TIMEOUT_S)
        except (ApplianceError, asyncio.TimeoutError, OSError):
            return None
        if status != 200:
            return None
        try:
            return parse(body.decode("utf-8", "replace"))
        except ValueError:  # not a Prometheus page
            return None

    async def close(self) -> None:
        await self.admin.close()


def local(server: Any) -> DeviceReader:
    """An in-process server's own telemetry."""

    async def read() -> list[f.Sample] | None:
        return list(server.server.telemetry.read())

    return read


def with_device(stats: StatsReader, device: DeviceReader) -> StatsReader:
    """The statistics reader, with the device's telemetry under ``"device"``."""

    async def read() -> dict[str, Any] | None:
        row = dict(await stats() or {})
        row["device"] = await device()
        return row

    return read
