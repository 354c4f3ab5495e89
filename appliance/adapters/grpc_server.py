"""The gRPC listener: one ``grpc.aio`` server in the running event loop, serving the
Triton service (:mod:`appliance.adapters.grpc_api`) and the standard ``grpc.health.v1``
service, with the HTTPS certificate settings (TLS, mutual TLS) and the bearer-token
rule of :mod:`appliance.adapters.access` as an interceptor.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from tritonclient.grpc import service_pb2_grpc

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


class _AccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The HTTP endpoint's token rule (:mod:`appliance.adapters.access`) for gRPC: the token
    comes as ``authorization: Bearer <token>`` metadata. A refused call ends with
    UNAUTHENTICATED (no or wrong token) or PERMISSION_DENIED (admin calls disabled)."""

    def __init__(self, policy: AccessPolicy) -> None:
        self._policy = policy

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        scope = rpc_scope(details.method)
        tokens = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        denial = self._policy.check_all(scope, tokens)
        handler = await continuation(details)
        if denial is None or handler is None:
            return handler
        code = grpc.StatusCode.UNAUTHENTICATED
        if denial.forbidden:
            code = grpc.StatusCode.PERMISSION_DENIED

        async def deny(request: Any, context: Any) -> None:
            await context.abort(code, denial.message)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


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
            interceptors=[_AccessInterceptor(self._access)] if self._access else None,
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            Servicer(self._dataplane), server
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
