"""The server process: model lifecycle, data plane and the HTTP and metrics endpoints.

Start-up: bind the endpoints (HTTP, gRPC, metrics: live at once, ready once the
initial models loaded), then load the repository, then start the MQTT bridge
(when configured; it connects in the background). Shutdown, as a checklist: the
MQTT bridge stops taking requests, answers those in flight and disconnects ->
readiness goes false and new inferences are refused -> listeners close and
in-flight HTTP and gRPC requests get up to ``drain_timeout_s`` to finish -> every
model drains its queue and unloads -> the metrics endpoint closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from appliance import bls, startup_report
from appliance.adapters.access import AccessPolicy, Scope, is_loopback
from appliance.adapters.grpc import libraries as grpc_libraries
from appliance.adapters.http import head as http_head
from appliance.adapters.http import listener, reads
from appliance.adapters.http.backstage import Backstage
from appliance.adapters.http.drain import close_http
from appliance.adapters.http.reads import Read, Routes
from appliance.adapters.tls import http_context
from appliance.config.fields import ConfigError
from appliance.core.dataplane import DataPlane
from appliance.core.lifecycle import ModelLifeCycle
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError
from appliance.streams.manager import Streams

if TYPE_CHECKING:
    from aiohttp import web

    from appliance.adapters.grpc.server import GrpcEndpoint
    from appliance.adapters.metrics import MetricsExporter
    from appliance.adapters.mqtt.bridge import MqttBridge
    from appliance.telemetry.device import Telemetry
from appliance.config.server_config import ServerConfig

log = logging.getLogger(__name__)


def demo_repository() -> Path:
    """The built-in demo models shipped as package data."""
    return Path(str(resources.files("appliance") / "demo_models"))


class Server:
    """One appliance inside the current event loop (usable from tests and apps)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.repository = config.model_repository or demo_repository()
        self.lifecycle = ModelLifeCycle(self.repository, config)
        self.access = AccessPolicy.from_config(config)
        self.dataplane = DataPlane(
            self.lifecycle, SharedMemoryRegistry(enabled=config.shared_memory == "system")
        )
        self._http: listener.Listener | None = None
        self._grpc: GrpcEndpoint | None = None
        self._metrics: listener.Listener | None = None
        self.mqtt: MqttBridge | None = None
        self._telemetry: Telemetry | None = None  # found on first use: see telemetry
        # made on the first scrape of the metrics endpoint (prometheus_client, the
        # device's telemetry: loaded then)
        self.metrics: MetricsExporter | None = None
        self._bls: bls.Binding | None = None
        self.vision = None
        if config.vision:
            from appliance.vision.detector import Detectors  # (Pillow: with vision only)

            self.vision = Detectors(self.dataplane, config.vision)
        self.streams = Streams(self.vision, config.mqtt)  # camera streams (docs/vision.md)
        self._reloads: set[asyncio.Task[None]] = set()
        self.http_port = 0
        self.grpc_port = 0
        self.metrics_port = 0

    def _bind(self, port: int) -> socket.socket:
        """The listening socket, bound here so that port 0 (tests) reports the port
        actually bound."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, port))
        except OSError as exc:
            sock.close()
            raise ConfigError(
                "<server>", "port", f"cannot listen on {self.config.host}:{port}: {exc.strerror}"
            ) from None
        return sock

    async def _backstage(self) -> web.AppRunner:
        """The aiohttp application behind the HTTP front, set up (on first need: see
        :mod:`appliance.adapters.http.backstage`)."""
        from aiohttp import web

        from appliance.adapters.http import api
        from appliance.adapters.http import limits as http_limits
        from appliance.adapters.http.vision import register as register_vision

        config = self.config
        app = api.create_app(
            self.dataplane, config.max_request_size, self.access, config.http_body_timeout_s
        )
        register_vision(app, self.vision, config.http_body_timeout_s, self.streams)
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=config.drain_timeout_s,
            **http_limits.runner_options(config),
        )
        await runner.setup()
        return runner

    async def _listen(
        self,
        port: int,
        tls: ssl.SSLContext | None,
        routes: Routes,
        backstage: Backstage | None,
        infer: bool = True,
    ) -> tuple[listener.Listener, int]:
        """An HTTP/1.1 endpoint on ``port``: the front (:mod:`appliance.adapters.http.front`)
        answering inference (unless ``infer`` is False) and ``routes``, with
        ``backstage`` behind it; returns it and the port bound."""
        config = self.config
        sock = self._bind(port)
        endpoint = await listener.listen(
            sock,
            tls,
            self.dataplane,
            self.access,
            config.max_request_size,
            config.http_header_timeout_s,
            config.http_body_timeout_s,
            routes,
            backstage,
            infer,
        )
        return endpoint, int(sock.getsockname()[1])

    async def start(self) -> None:
        """Bind the endpoints, then load the model repository."""
        started = time.perf_counter()
        tls = http_context(self.config)
        if self.config.http_port >= 0:
            # KServe v2: inference and the read-only routes on the front; every other
            # request's connection to the aiohttp application, set up on first need
            backstage = Backstage(self._backstage)
            routes = reads.routes(self.dataplane)
            self._http, self.http_port = await self._listen(
                self.config.http_port, tls, routes, backstage
            )
        if self.config.metrics_port >= 0:  # GET /metrics only, nothing behind it
            metrics = {"metrics": (Scope.PUBLIC, self._render_metrics)}
            self._metrics, self.metrics_port = await self._listen(
                self.config.metrics_port, None, metrics, None, infer=False
            )
        if self.config.grpc_port >= 0:
            await self._start_grpc()
        host = self.config.host
        endpoints = [
            f"{'https' if tls else 'http'}://{host}:{self.http_port} (KServe v2)"
            if self._http
            else "",
            f"grpc{'+tls' if tls else ''} {host}:{self.grpc_port}" if self._grpc else "",
            f"metrics http://{host}:{self.metrics_port}/metrics" if self._metrics else "",
        ]
        log.info("listening: %s", ", ".join(e for e in endpoints if e) or "in-process only")
        tokens = self.config.admin_token or self.config.inference_token
        if tokens and not is_loopback(host) and tls is None:
            log.warning("bearer tokens travel in clear text on %s: set tls_cert and tls_key", host)
        # Python models calling other models (BLS) reach them through this data plane
        self._bls = bls.register(self.repository, asyncio.get_running_loop(), self.dataplane)
        await self.lifecycle.start()
        # the log says what readiness says, and names what failed
        startup_report.report(
            startup_report.summarize(self.lifecycle.index()),
            self.repository,
            time.perf_counter() - started,
            self.config.memory_limit,
        )
        await self._start_mqtt()
        await self.streams.apply(self.config.streams, self.vision)

    async def _start_grpc(self) -> None:
        """The gRPC endpoint, an extra: when its libraries cannot load, a port asked for
        (flag or config file) stops the start with one line naming the fix; the default
        port turns the endpoint off with a warning."""
        problem = grpc_libraries.missing()
        if problem is not None:
            reason = f"the gRPC libraries do not load ({problem})"
            if self.config.grpc_port_given:
                raise ConfigError(
                    "<server>",
                    "grpc_port",
                    f"cannot serve gRPC on port {self.config.grpc_port}: {reason}: "
                    f"{grpc_libraries.FIX}, or grpc_port: -1",
                )
            log.warning("gRPC endpoint off: %s: %s (or grpc_port: -1)", reason, grpc_libraries.FIX)
            return
        from appliance.adapters.grpc.server import GrpcEndpoint, grpc_limits

        self._grpc = GrpcEndpoint(
            self.dataplane,
            self.config.host,
            self.config.grpc_port,
            self.config.max_request_size,
            access=self.access,
            tls=http_context(self.config),
            limits=grpc_limits(self.config),
        )
        self.grpc_port = await self._grpc.start()

    async def _start_mqtt(self) -> None:
        """The MQTT bridge, once the models are loaded; it connects in the background,
        and nothing about it (even a missing paho) can stop HTTP and gRPC serving."""
        if self.config.mqtt is None:
            return
        try:
            from appliance.adapters.mqtt.bridge import MqttBridge

            bridge = MqttBridge(self.config.mqtt, self.dataplane, self.config.max_request_size)
            await bridge.start()
        except Exception as exc:
            log.error("MQTT bridge disabled: %s", exc)
            return
        self.mqtt = bridge

    def reload_soon(self, reread: Callable[[], ServerConfig]) -> None:
        """A config reload (SIGHUP): the file read again and its ``streams:`` applied
        (streams added, changed or removed; the others keep running). A file that no
        longer validates changes nothing."""
        try:
            config = reread()
        except ApplianceError as exc:
            log.error("config reload refused, nothing changed: %s", exc)
            return
        if config.vision != self.config.vision:
            log.warning("config reload: vision: changes take effect at the next start")
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.streams.apply(config.streams, self.vision))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    @property
    def telemetry(self) -> Telemetry:
        """What this device exposes (thermal zones, clocks, power rails, GPUs through
        NVML), found once, on first use: when the metrics endpoint starts, or never
        (no sysfs walk, no NVML) on a server without one."""
        if self._telemetry is None:
            from appliance.telemetry.device import Telemetry

            self._telemetry = Telemetry.discover()
        return self._telemetry

    def _exporter(self) -> MetricsExporter:
        """The Prometheus exporter; prometheus_client loads only when metrics are
        scraped."""
        from appliance.adapters import metrics
        from appliance.streams.metrics import StreamsCollector

        exporter = metrics.MetricsExporter(
            metrics.Sources(
                models=lambda: (mv.stats for mv in self.lifecycle.loaded()),
                budget=self.dataplane.memory,
                mqtt=self._mqtt_counters,
                queued=lambda: (self.dataplane.queued.held, self.dataplane.queued.limit),
                telemetry=self.telemetry.read,
            )
        )
        exporter.registry.register(StreamsCollector(lambda: list(self.streams.running.values())))
        return exporter

    def _render_metrics(self, head: http_head.Head) -> Read:
        """``GET /metrics``: the exposition the ``Accept`` header asks for."""
        if self.metrics is None:
            self.metrics = self._exporter()
        accept = next((v for k, v in head.headers() if k.lower() == "accept"), "")
        body, content_type = self.metrics.render(accept)
        return 200, body, content_type.encode("latin-1")

    def _mqtt_counters(self) -> dict[str, int] | None:
        return None if self.mqtt is None else self.mqtt.stats.snapshot()

    async def stop(self) -> None:
        """Graceful shutdown; see the module docstring for the order."""
        log.info("shutting down: draining for up to %.0fs", self.config.drain_timeout_s)
        await self.streams.stop()
        mqtt_bridge, self.mqtt = self.mqtt, None
        if mqtt_bridge is not None:  # first: its requests in flight still get answers
            await mqtt_bridge.stop(self.config.drain_timeout_s)
        self.dataplane.accepting = False
        http, grpc, metrics_runner = self._http, self._grpc, self._metrics
        self._http = self._grpc = self._metrics = None
        # close both listeners; each waits for its in-flight requests (HTTP: and for
        # requests already received on keep-alive connections, see http_drain)
        await asyncio.gather(
            *([close_http(http, self.config.drain_timeout_s)] if http else []),
            *([grpc.stop(self.config.drain_timeout_s)] if grpc else []),
        )
        await self.lifecycle.stop(self.config.drain_timeout_s)
        await self.dataplane.tracer.stop()
        if self._bls is not None:
            bls.unregister(self.repository, self._bls)
            self._bls = None
        if metrics_runner is not None:
            await close_http(metrics_runner, 1.0)
        if self._telemetry is not None:
            self._telemetry.close()
        log.info("stopped")
