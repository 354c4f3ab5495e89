"""KServe v2 / Triton gRPC service (``inference.GRPCInferenceService``) over the data plane.

The RPC handlers, with Triton's published service definitions (the generated
modules tritonclient ships). Every RPC is a thin call into :class:`DataPlane`;
:class:`ApplianceError` codes become gRPC status codes as Triton maps them, and
any other exception is logged and answered INTERNAL. The listener that serves it
(TLS, access control, health) is :mod:`appliance.adapters.grpc.server`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from appliance.adapters import exchange, forwarding, offload, request_form
from appliance.adapters.codec import kserve_plan
from appliance.adapters.grpc import calls, codec, stream
from appliance.adapters.grpc import settings as grpc_settings
from appliance.adapters.grpc import wire as grpc_wire
from appliance.adapters.grpc.calls import Held
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.core.servable import Servable
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceResponse

log = logging.getLogger(__name__)

STATUS = {
    Code.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}
# messages above this are decoded/encoded on a worker thread: BYTES tensors and typed
# contents are parsed element by element, which would stall every other call

R = TypeVar("R")
S = TypeVar("S")
Unary = Callable[[S, Any, Any], Awaitable[R]]


def _guarded(method: Unary[S, R]) -> Unary[S, R]:
    """Answer an :class:`ApplianceError` with its gRPC status and any other exception
    with INTERNAL (traceback logged); the server keeps serving either way."""

    @functools.wraps(method)
    async def wrapper(self: S, request: Any, context: Any) -> R:
        try:
            if isinstance(request, grpc_wire.Undecodable):
                raise request.error
            return await method(self, request, context)
        except ApplianceError as exc:
            code, message = STATUS[exc.code], exc.message
        except Exception as exc:  # a bug: answer INTERNAL and keep serving
            log.exception("unhandled error in gRPC %s", method.__name__)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {exc}"
        await context.abort(code, message)  # raises: ends the call with that status
        raise AssertionError("unreachable")

    return wrapper


def _params(params: Any) -> dict[str, Any]:
    """A protobuf map of oneof parameters -> plain values."""
    return {
        k: getattr(v, v.WhichOneof("parameter_choice") or "string_param") for k, v in params.items()
    }


class _Message:
    """ModelInfer's payload: the message's bytes, the call's headers the server forwards
    as parameters, and the message once protobuf has parsed it (by the plan or the
    reader, whichever looks first: parsed once)."""

    __slots__ = ("forwarded", "parsed", "wire")

    def __init__(self, wire: bytes, forwarded: forwarding.Headers) -> None:
        self.wire = wire
        self.forwarded = forwarded
        self.parsed: Any = None

    def message(self) -> Any:
        if self.parsed is None:
            self.parsed = grpc_wire.parse_request(self.wire)
        return self.parsed


class _InferWire(exchange.Wire[bytes]):
    """ModelInfer: the message's bytes -> the form (parsed once by protobuf's C parser;
    a big message's raw inputs as views of it); the answer -> the framed
    ``ModelInferResponse`` bytes, outputs joined once (:mod:`appliance.adapters.grpc.wire`).
    A plain message is read by its version's plan (:mod:`appliance.adapters.codec.kserve_plan`)."""

    endpoint = "ModelInfer RPC"
    joins = True

    def read(self, payload: Any, ticket: Ticket | None) -> request_form.RequestForm:
        wire = payload.wire
        message = payload.message()
        raw = grpc_wire.raw_contents(wire) if len(wire) > offload.OFFLOAD_BYTES else None
        form = codec.parse_request(message, raw)
        if payload.forwarded:  # the call's headers the server forwards as parameters
            forwarding.apply(form, payload.forwarded)
        return form

    def plan(
        self, payload: Any, serving: Callable[[str, str], Servable | None], max_elements: int
    ) -> exchange.Planned | None:
        if payload.forwarded:
            return None
        return kserve_plan.plan_message(payload.message(), serving, max_elements)

    def encode(self, response: InferenceResponse, fmt: Any, shm: Any) -> bytes:
        return grpc_wire.encode_response(response, fmt.shared_memory, shm, True)


INFER = _InferWire()


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """One method per RPC of ``inference.GRPCInferenceService``."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dp = dataplane

    # ---- health and metadata -----------------------------------------------------------

    @_guarded
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=self.dp.live)

    @_guarded
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.dp.ready())

    @_guarded
    async def ModelReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ModelReadyResponse(
            ready=self.dp.model_ready(request.name, request.version)
        )

    @_guarded
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return json_format.ParseDict(
            self.dp.server_metadata(),
            service_pb2.ServerMetadataResponse(),
            ignore_unknown_fields=True,
        )

    @_guarded
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        doc = self.dp.model_metadata(request.name, request.version)
        return json_format.ParseDict(
            doc, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True
        )

    @_guarded
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        config = json_format.ParseDict(
            self.dp.model_config(request.name, request.version),
            model_config_pb2.ModelConfig(),
            ignore_unknown_fields=True,
        )
        return service_pb2.ModelConfigResponse(config=config)

    @_guarded
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return json_format.ParseDict(
            self.dp.statistics(request.name, request.version),
            service_pb2.ModelStatisticsResponse(),
            ignore_unknown_fields=True,
        )

    # ---- inference ---------------------------------------------------------------------

    @_guarded
    async def ModelInfer(self, held: Held, context: Any) -> Any:
        """Bytes in, bytes out, through the one exchange (:mod:`exchange`): the message
        is parsed once (:mod:`appliance.adapters.grpc.wire`), its raw inputs are views of
        the wire, its outputs joined once behind gRPC's message prefix, written by the call
        (``context.answer``) before the queued bytes held since its length prefix are
        released."""
        wire, hold = held
        size = len(wire)
        forwarded = self._forwarded(context)
        await exchange.serve(
            self.dp, INFER, _Message(wire, forwarded), size, hold=hold, deliver=context.answer
        )
        return calls.ANSWERED

    def _forwarded(self, context: Any) -> forwarding.Headers:
        """The call's headers forwarded as request parameters (the server's
        ``grpc_header_forward_pattern``; none without one)."""
        pattern = self.dp.lifecycle.server.grpc_header_forward_pattern
        if not pattern:
            return ()
        return forwarding.select(context.invocation_metadata(), pattern)

    def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Bidirectional stream (:func:`appliance.adapters.grpc.stream.serve`)."""
        return stream.serve(self.dp, request_iterator, self._forwarded(context))

    # ---- trace and log settings ----------------------------------------------------------

    @_guarded
    async def TraceSetting(self, request: Any, context: Any) -> Any:
        if request.model_name:
            self.dp.lifecycle.entry(request.model_name)  # Triton's error for an unknown model
        changes = grpc_settings.trace_changes(request)
        tracer = self.dp.tracer
        if changes:
            return grpc_settings.trace_response(tracer.update(changes, request.model_name))
        return grpc_settings.trace_response(tracer.settings(request.model_name))

    @_guarded
    async def LogSettings(self, request: Any, context: Any) -> Any:
        changes = grpc_settings.log_changes(request)
        settings = self.dp.log_settings
        return grpc_settings.log_response(
            settings.update(changes) if changes else settings.settings()
        )

    # ---- repository ---------------------------------------------------------------------

    @_guarded
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        response = service_pb2.RepositoryIndexResponse()
        for row in self.dp.repository_index(request.ready):
            response.models.add(
                name=row["name"],
                version=row.get("version", ""),
                state=row.get("state", ""),
                reason=row.get("reason", ""),
            )
        return response

    @_guarded
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self.dp.load_model(request.model_name, _params(request.parameters))
        return service_pb2.RepositoryModelLoadResponse()

    @_guarded
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        # parameters such as unload_dependents are accepted, unused (as over HTTP)
        await self.dp.unload_model(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    # ---- shared memory ------------------------------------------------------------------

    @_guarded
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for region in self.dp.shared_memory.status(request.name):
            response.regions[region["name"]].CopyFrom(
                service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    @_guarded
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.dp.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    @_guarded
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.dp.shared_memory.unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    @_guarded
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = service_pb2.CudaSharedMemoryStatusResponse()
        for region in self.dp.cuda_shared_memory.status(request.name):
            response.regions[region["name"]].CopyFrom(
                service_pb2.CudaSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    @_guarded
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.dp.cuda_shared_memory.register(request.name, request.device_id, request.byte_size)
        return service_pb2.CudaSharedMemoryRegisterResponse()

    @_guarded
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.dp.cuda_shared_memory.unregister(request.name)
        return service_pb2.CudaSharedMemoryUnregisterResponse()
