"""The gRPC listener: an asyncio server in the running event loop, speaking HTTP/2
(:mod:`appliance.adapters.grpc.h2.connection`) and gRPC (:mod:`appliance.adapters.grpc.calls`),
serving the Triton service (:mod:`appliance.adapters.grpc.api`) and the standard
``grpc.health.v1`` service (:mod:`appliance.adapters.grpc.services`, imported with the
first connection), with the HTTPS certificate settings (TLS with ALPN ``h2``, mutual
TLS) and the bearer-token rule of :mod:`appliance.adapters.access` checked by each
RPC's handler.

Why not grpcio's server: its asyncio server spent more CPU per ModelInfer on its own
machinery (completion queue, a poller thread waking the loop, Cython call objects)
than this server's whole HTTP path (docs/benchmarks.md, "gRPC"); its thread-pool
server, handing calls to the event loop, was no better once several calls were in
flight (a thread per call, each one waking the loop). Messages are the generated
protobuf classes tritonclient ships; ModelInfer is read and written as bytes
(:mod:`appliance.adapters.grpc.wire`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import ssl
from typing import TYPE_CHECKING, Any

from appliance.adapters.access import AccessPolicy
from appliance.adapters.grpc.h2.accept import Admission
from appliance.adapters.grpc.h2.connection import Connection
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.config.fields import ConfigError
from appliance.config.server_config import ServerConfig
from appliance.core.dataplane import DataPlane

if TYPE_CHECKING:
    from appliance.adapters.grpc.dispatch import Dispatcher
    from appliance.adapters.grpc.h2.frames import Stream
    from appliance.adapters.grpc.services import Health

log = logging.getLogger(__name__)

def grpc_limits(config: ServerConfig) -> H2Limits:
    """The HTTP/2 limits the server config sets (``grpc_*``)."""
    return H2Limits(
        max_connections=config.grpc_max_connections,
        max_concurrent_streams=config.grpc_max_concurrent_streams,
        max_header_list_size=config.grpc_max_header_list_size,
        idle_timeout_s=config.grpc_idle_timeout_s,
        read_timeout_s=config.grpc_read_timeout_s,
    )


class GrpcEndpoint:
    """The gRPC listener: one asyncio server in the running event loop. The services
    (:mod:`appliance.adapters.grpc.services`: grpcio's status codes, protobuf, Triton's
    generated messages) are imported when the first connection arrives, on a worker
    thread while the event loop goes on serving; the connections that arrive
    meanwhile are not read until they are in (:meth:`Connection.hold`)."""

    def __init__(
        self,
        dataplane: DataPlane,
        host: str,
        port: int,
        max_message_size: int,
        access: AccessPolicy | None = None,
        tls: ssl.SSLContext | None = None,
        limits: H2Limits | None = None,
    ) -> None:
        self._dataplane = dataplane
        # the windows sized for max_message_size (H2Limits.for_message)
        self._limits = (limits or H2Limits()).for_message(max_message_size)
        self._tls = tls
        self._host = host
        self._port = port
        self._max_message_size = max_message_size
        self._access = access or AccessPolicy()
        self._server: asyncio.Server | None = None
        self._admission: Admission | None = None
        self._health: Health | None = None  # with the services
        self._dispatcher: Dispatcher | None = None
        self._loading: asyncio.Future[None] | None = None

    def open(self, connection: Any, stream: Stream) -> None:
        """A stream of a connection accepted before the services were in (read only
        once they are: see :meth:`_connection`)."""
        assert self._dispatcher is not None
        self._dispatcher.open(connection, stream)

    def _connection(self, on_close: Any) -> Connection:
        if self._dispatcher is not None:
            return Connection(self._dispatcher, self._max_message_size, on_close, self._limits)
        conn = Connection(self, self._max_message_size, on_close, self._limits)
        conn.hold(self._load())
        return conn

    def _load(self) -> asyncio.Future[None]:
        """The services, imported once (a failed import is tried again by the next
        connection; those waiting on it are closed)."""
        loading = self._loading
        if loading is None or (loading.done() and (loading.cancelled() or loading.exception())):
            loading = self._loading = asyncio.ensure_future(self._import())
        return loading

    async def _import(self) -> None:
        try:
            module = await asyncio.to_thread(
                importlib.import_module, "appliance.adapters.grpc.services"
            )
        except Exception as exc:
            log.error("gRPC call refused: the gRPC libraries do not load: %s", exc)
            raise
        health = module.Health()
        self._dispatcher = module.dispatcher(self._dataplane, self._access, health)
        self._health = health
        if self._server is None:  # stopped meanwhile
            health.set(False)

    async def start(self) -> int:
        """Bind ``host:port`` (port 0: a free port) and serve; returns the bound port.

        Raises :class:`ConfigError` when the address cannot be bound.
        """
        if self._tls is not None:
            self._tls.set_alpn_protocols(["h2"])
        self._admission = Admission(self._limits, self._connection)
        loop = asyncio.get_running_loop()
        address = f"{self._host}:{self._port}"
        # a TLS handshake must finish within the read timeout too (asyncio's default: 60 s)
        handshake = self._limits.read_timeout_s if self._tls is not None else None
        try:
            self._server = await loop.create_server(
                self._admission.protocol,
                self._host,
                self._port,
                ssl=self._tls,
                reuse_port=False,
                ssl_handshake_timeout=handshake,
            )
        except OSError as exc:
            reason = f"cannot listen on {address}: {exc}"
            raise ConfigError("<server>", "grpc_port", reason) from None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def connections(self) -> list[Connection]:
        """The connections open (or in their TLS handshake) now."""
        return self._admission.open() if self._admission is not None else []

    async def stop(self, grace_s: float) -> None:
        """Stop accepting at once; in-flight RPCs (streams included) get ``grace_s``
        seconds to finish, then are cancelled. Health turns NOT_SERVING first."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._health is not None:
            self._health.set(False)
        server.close()
        for conn in list(self.connections):
            conn.goaway()
        calls = {task for conn in self.connections for task in conn.calls}
        if calls:
            _, pending = await asyncio.wait(calls, timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self.connections):
            conn.close()
        await server.wait_closed()
