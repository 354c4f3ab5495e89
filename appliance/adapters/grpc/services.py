"""The services the gRPC listener (:mod:`appliance.adapters.grpc.server`) serves, and
the dispatcher that routes its calls to them: the Triton service
(:mod:`appliance.adapters.grpc.api`, ``inference.GRPCInferenceService``) and the standard
``grpc.health.v1`` service, with the bearer-token rule of
:mod:`appliance.adapters.access` checked from each call's HEADERS. The listener
imports this module (grpcio's status codes, protobuf and Triton's generated messages)
on a worker thread when its first connection arrives, not at start-up.
"""

from __future__ import annotations

import asyncio
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
from appliance.core.dataplane import DataPlane

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


def dispatcher(dataplane: DataPlane, access: AccessPolicy, health: Health) -> dispatch.Dispatcher:
    """Every RPC of both services, behind the token rule (``health`` SERVING now)."""
    methods = triton_methods(Servicer(dataplane))
    methods.update(health.methods())
    health.set(True)
    return dispatch.Dispatcher(methods, authorizer(access), dataplane.reserve)
