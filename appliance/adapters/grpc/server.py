"""The gRPC listener: an asyncio server in the running event loop, speaking HTTP/2
(:mod:`appliance.adapters.grpc.h2.connection`) and gRPC (:mod:`appliance.adapters.grpc.calls`),
serving the Triton service (:mod:`appliance.adapters.grpc.api`) and the standard
``grpc.health.v1`` service, with the HTTPS certificate settings (TLS with ALPN
``h2``, mutual TLS) and the bearer-token rule of :mod:`appliance.adapters.access`
checked by each RPC's handler.

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
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.grpc import calls as grpc_calls
from appliance.adapters.grpc import dispatch, wire
from appliance.adapters.grpc import health_proto as health_pb2
from appliance.adapters.grpc.api import Servicer
from appliance.adapters.grpc.calls import Context, Method
from appliance.adapters.grpc.h2.accept import Admission
from appliance.adapters.grpc.h2.connection import Connection
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.config.fields import ConfigError
from appliance.config.server_config import ServerConfig
from appliance.core.dataplane import DataPlane

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
HEALTH = health_pb2.SERVICE
# who may call each RPC of the services this listener registers (GrpcEndpoint.start);
# an RPC missing here counts as admin (tests/adapters/test_auth.py checks every RPC of
# both services is declared)
RPC_SCOPES: dict[str, Scope] = {
    f"/{service}/{method}": scope
    for service, scope, methods in (
        (HEALTH, Scope.PUBLIC, ("Check", "Watch", "List")),
        (SERVICE, Scope.PUBLIC, ("ServerLive", "ServerReady", "ServerMetadata")),
        (
            SERVICE,
            Scope.INFERENCE,
            (
                "ModelReady",
                "ModelMetadata",
                "ModelConfig",
                "ModelStatistics",
                "ModelInfer",
                "ModelStreamInfer",
                "RepositoryIndex",
                "SystemSharedMemoryStatus",
                "CudaSharedMemoryStatus",
            ),
        ),
        (
            SERVICE,
            Scope.ADMIN,
            (
                "RepositoryModelLoad",
                "RepositoryModelUnload",
                "SystemSharedMemoryRegister",
                "SystemSharedMemoryUnregister",
                "CudaSharedMemoryRegister",
                "CudaSharedMemoryUnregister",
                "TraceSetting",
                "LogSettings",
            ),
        ),
    )
    for method in methods
}


def rpc_scope(method: str) -> Scope:
    """Who may call ``method`` (``/package.Service/Method``): its declared scope, else
    admin."""
    return RPC_SCOPES.get(method, Scope.ADMIN)


def authorizer(policy: AccessPolicy) -> dispatch.Authorize:
    """The HTTP endpoint's token rule (:mod:`appliance.adapters.access`) for every RPC,
    applied by the dispatcher to a call's HEADERS, before any of its DATA is kept: the
    token comes as ``authorization: Bearer <token>`` metadata. A refused call ends
    with UNAUTHENTICATED (no or wrong token) or PERMISSION_DENIED (admin calls
    disabled), trailers-only, and its stream is reset."""

    def authorize(path: str, tokens: list[str]) -> tuple[grpc.StatusCode, str] | None:
        scope = rpc_scope(path)
        if scope is Scope.PUBLIC:
            return None
        denial = policy.check_all(scope, tokens)
        if denial is None:
            return None
        if denial.forbidden:
            return grpc.StatusCode.PERMISSION_DENIED, denial.message
        return grpc.StatusCode.UNAUTHENTICATED, denial.message

    return authorize


def _bytes(data: bytes) -> bytes:
    return data


def triton_methods(servicer: Servicer) -> dict[str, Method]:
    """``inference.GRPCInferenceService``. ModelInfer takes and returns bytes
    (:mod:`appliance.adapters.grpc.wire`); every other request is parsed by protobuf,
    and one that does not parse (a name that is not UTF-8) reaches its RPC as
    :class:`wire.Undecodable`, answered INVALID_ARGUMENT. The inference RPCs take
    each request with the queued bytes its message holds (``held``); a public RPC's
    request is at most :data:`grpc_calls.PUBLIC_MESSAGE` bytes."""
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    methods = {}
    for rpc in service.methods:
        streaming = rpc.client_streaming
        path = f"/{SERVICE}/{rpc.name}"
        behavior = getattr(servicer, rpc.name)
        if rpc.name == "ModelInfer":
            methods[path] = Method(
                grpc_calls.UNARY, behavior, _bytes, _bytes, framed=True, held=True
            )
            continue
        request = getattr(service_pb2, rpc.input_type.name)
        write = getattr(service_pb2, rpc.output_type.name).SerializeToString
        kind = grpc_calls.STREAM if streaming else grpc_calls.UNARY
        public = rpc_scope(path) is Scope.PUBLIC
        parse = wire.parse_or_undecodable(request)
        methods[path] = Method(kind, behavior, parse, write, held=streaming, public=public)
    return methods


class Health:
    """``grpc.health.v1.Health``: SERVING for the server ("") and the Triton service
    while the endpoint runs, NOT_SERVING once it stops; ``Watch`` streams changes and
    ends after NOT_SERVING (so an open watch does not hold the shutdown's grace)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._stopped = False

    def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        value = status.SERVING if serving else status.NOT_SERVING
        self._status = {"": value, SERVICE: value}
        self._stopped = not serving
        self._changed.set()
        self._changed = asyncio.Event()

    async def check(self, request: Any, context: Context) -> Any:
        if isinstance(request, wire.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)

    async def watch(self, request: Any, context: Context) -> AsyncIterator[Any]:
        if isinstance(request, wire.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        last = None
        while True:
            status = self._status.get(request.service, unknown)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self._stopped:  # NOT_SERVING sent: the stream ends, shutdown need not wait
                return
            await self._changed.wait()

    async def list(self, request: Any, context: Context) -> Any:
        response = health_pb2.HealthListResponse()
        for service, status in self._status.items():
            response.statuses[service].status = status
        return response

    def methods(self) -> dict[str, Method]:
        parse = wire.parse_or_undecodable(health_pb2.HealthCheckRequest)
        write = health_pb2.HealthCheckResponse.SerializeToString
        base = f"/{HEALTH}/"
        methods = {
            base + "Check": Method(grpc_calls.UNARY, self.check, parse, write, public=True),
            base + "Watch": Method(grpc_calls.SERVER_STREAM, self.watch, parse, write, public=True),
        }
        methods[base + "List"] = Method(
            grpc_calls.UNARY,
            self.list,
            wire.parse_or_undecodable(health_pb2.HealthListRequest),
            health_pb2.HealthListResponse.SerializeToString,
            public=True,
        )
        return methods


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
    """The gRPC listener: one asyncio server in the running event loop."""

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
        self._health = Health()

    async def start(self) -> int:
        """Bind ``host:port`` (port 0: a free port) and serve; returns the bound port.

        Raises :class:`ConfigError` when the address cannot be bound.
        """
        methods = triton_methods(Servicer(self._dataplane))
        methods.update(self._health.methods())
        self._health.set(True)
        dispatcher = dispatch.Dispatcher(methods, authorizer(self._access), self._dataplane.reserve)
        if self._tls is not None:
            self._tls.set_alpn_protocols(["h2"])

        def connection(on_close: Any) -> Connection:
            return Connection(dispatcher, self._max_message_size, on_close, self._limits)

        self._admission = Admission(self._limits, connection)
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
