"""The gRPC listener: one ``grpc.aio`` server in the running event loop, serving the
Triton service (:mod:`appliance.adapters.grpc_api`) and the standard ``grpc.health.v1``
service, with the HTTPS certificate settings (TLS, mutual TLS) and the bearer-token
rule of :mod:`appliance.adapters.access` checked by each RPC's handler.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from appliance.adapters import grpc_wire
from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.grpc_api import Servicer
from appliance.adapters.tls import TlsFiles
from appliance.config.fields import ConfigError
from appliance.core.dataplane import DataPlane

try:  # grpcio-health-checking is a dependency; a trimmed image may lack it
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:  # pragma: no cover - exercised only on such images
    health = None

log = logging.getLogger(__name__)


SERVICE = "inference.GRPCInferenceService"
HEALTH = "grpc.health.v1.Health"
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


def _guard(behavior: Any, scope: Scope, policy: AccessPolicy, streaming: bool) -> Any:
    """The HTTP endpoint's token rule (:mod:`appliance.adapters.access`) for one RPC: the
    token comes as ``authorization: Bearer <token>`` metadata. A refused call ends with
    UNAUTHENTICATED (no or wrong token) or PERMISSION_DENIED (admin calls disabled).
    Checked in the handler itself: an interceptor costs a coroutine and a handler
    look-up on every call."""
    if scope is Scope.PUBLIC:
        return behavior

    async def refuse(context: Any) -> None:
        tokens = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        denial = policy.check_all(scope, tokens)
        if denial is not None:
            code = grpc.StatusCode.UNAUTHENTICATED
            if denial.forbidden:
                code = grpc.StatusCode.PERMISSION_DENIED
            await context.abort(code, denial.message)

    if streaming:

        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            await refuse(context)
            async for response in behavior(requests, context):
                yield response

        return stream

    async def unary(request: Any, context: Any) -> Any:
        await refuse(context)
        return await behavior(request, context)

    return unary


def triton_service(servicer: Servicer, policy: AccessPolicy) -> Any:
    """``inference.GRPCInferenceService`` as one generic handler, each RPC with its
    access scope. ModelInfer takes and returns bytes (:mod:`appliance.adapters.grpc_wire`);
    every other request is parsed by protobuf, and one that does not parse (a name
    that is not UTF-8) reaches its RPC as :class:`grpc_wire.Undecodable`, answered
    INVALID_ARGUMENT instead of grpcio's UNKNOWN."""
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        scope = rpc_scope(f"/{service.full_name}/{method.name}")
        behavior = _guard(getattr(servicer, method.name), scope, policy, method.client_streaming)
        if method.name == "ModelInfer":
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behavior)
            continue
        request = getattr(service_pb2, method.input_type.name)
        response = getattr(service_pb2, method.output_type.name)
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            behavior,
            request_deserializer=grpc_wire.parse_or_undecodable(request),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


class GrpcEndpoint:
    """The gRPC listener: owns one ``grpc.aio`` server in the running event loop."""

    def __init__(
        self,
        dataplane: DataPlane,
        host: str,
        port: int,
        max_message_size: int,
        access: AccessPolicy | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self._dataplane = dataplane
        self._tls = tls
        self._host = host
        self._port = port
        self._max_message_size = max_message_size
        self._access = access
        self._server: Any = None
        self._health: Any = None

    async def start(self) -> int:
        """Bind ``host:port`` (port 0: a free port) and serve; returns the bound port.

        Raises :class:`ConfigError` when the address cannot be bound.
        """
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_size),
                ("grpc.max_send_message_length", self._max_message_size),
                # without this a second server could silently share the port
                ("grpc.so_reuseport", 0),
            ],
        )
        server.add_generic_rpc_handlers(
            (triton_service(Servicer(self._dataplane), self._access or AccessPolicy()),)
        )
        if health is not None:
            self._health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        else:
            log.warning("grpc.health.v1 disabled: pip install grpcio-health-checking")
        address = (
            f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        )
        try:
            if self._tls is None:
                port = server.add_insecure_port(address)
            else:  # the HTTPS settings; a client CA makes client certificates mandatory
                credentials = grpc.ssl_server_credentials(
                    [(self._tls.key, self._tls.cert)],
                    root_certificates=self._tls.client_ca,
                    require_client_auth=self._tls.client_ca is not None,
                )
                port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:  # grpcio raises where older versions returned 0
            port, reason = 0, str(exc)
        else:
            reason = "the address is in use or not local"
        if port == 0:
            raise ConfigError("<server>", "grpc_port", f"cannot listen on {address}: {reason}")
        if self._health is not None:
            serving = health_pb2.HealthCheckResponse.SERVING
            for service in ("", "inference.GRPCInferenceService"):
                await self._health.set(service, serving)
        await server.start()
        self._server = server
        return int(port)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting at once; in-flight RPCs (streams included) get ``grace_s``
        seconds to finish, then are cancelled. Health turns NOT_SERVING first."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await server.stop(grace_s)
