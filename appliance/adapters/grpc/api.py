"""KServe v2 / Triton gRPC service (``inference.GRPCInferenceService``) over the data plane.

The RPC handlers, with Triton's published service definitions (the generated
modules tritonclient ships). Every RPC is a thin call into :class:`DataPlane`;
:class:`ApplianceError` codes become gRPC status codes as Triton maps them, and
any other exception is logged and answered INTERNAL. The listener that serves it
(TLS, access control, health) is :mod:`appliance.adapters.grpc.server`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from appliance import datatypes
from appliance.adapters import exchange, forwarding, offload, request_form
from appliance.adapters.grpc import calls, codec
from appliance.adapters.grpc import settings as grpc_settings
from appliance.adapters.grpc import wire as grpc_wire
from appliance.adapters.grpc.calls import Held
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.core.queue_bytes import Hold
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
# requests of one stream in flight at once; past it the stream is not read further
# (gRPC flow control then holds the client back)
STREAM_WINDOW = 64

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


def _declared_bytes(request: Any) -> int:
    """What the request's inputs claim to weigh (BYTES counted as one byte an element)."""
    total = 0
    for tensor in request.inputs:
        known = tensor.datatype in datatypes.DATATYPES
        itemsize = datatypes.byte_size(tensor.datatype, [1]) if known else None
        total += math.prod(tensor.shape) * (itemsize or 1)
    return total


class _InferWire(exchange.Wire[bytes]):
    """ModelInfer: the message's bytes -> the form (parsed once by protobuf's C parser;
    a big message's raw inputs as views of it); the answer -> the framed
    ``ModelInferResponse`` bytes, outputs joined once (:mod:`appliance.adapters.grpc.wire`)."""

    endpoint = "ModelInfer RPC"
    joins = True

    def read(self, payload: Any, ticket: Ticket | None) -> request_form.RequestForm:
        wire, forwarded = payload
        message = grpc_wire.parse_request(wire)
        raw = grpc_wire.raw_contents(wire) if len(wire) > offload.OFFLOAD_BYTES else None
        form = codec.parse_request(message, raw)
        if forwarded:  # the call's headers the server forwards as parameters
            forwarding.apply(form, forwarded)
        return form

    def encode(self, response: InferenceResponse, fmt: Any, shm: Any) -> bytes:
        return grpc_wire.encode_response(response, fmt.shared_memory, shm, True)


class _StreamWire(exchange.Wire[Any]):
    """ModelStreamInfer: a parsed ``ModelInferRequest`` -> the form; the answer -> a
    ``ModelInferResponse`` (the stream wraps it)."""

    endpoint = "ModelStreamInfer RPC"
    joins = True

    def read(self, payload: Any, ticket: Ticket | None) -> request_form.RequestForm:
        message, forwarded = payload
        form = codec.parse_request(message)
        if forwarded:  # the stream's headers the server forwards as parameters
            forwarding.apply(form, forwarded)
        return form

    def encode(self, response: InferenceResponse, fmt: Any, shm: Any) -> Any:
        return codec.encode_response(response, fmt.shared_memory, shm)


INFER, STREAM_INFER = _InferWire(), _StreamWire()


def _releasing(hold: Hold) -> Callable[[Any], None]:
    """A task's done callback that gives ``hold`` back."""
    return lambda _: hold.release()


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
            self.dp, INFER, (wire, forwarded), size, hold=hold, deliver=context.answer
        )
        return calls.ANSWERED

    def _forwarded(self, context: Any) -> forwarding.Headers:
        """The call's headers forwarded as request parameters (the server's
        ``grpc_header_forward_pattern``; none without one)."""
        pattern = self.dp.lifecycle.server.grpc_header_forward_pattern
        if not pattern:
            return ()
        return forwarding.select(context.invocation_metadata(), pattern)

    def _stream_error(self, request: Any, message: str) -> Any:
        echo = service_pb2.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=echo)

    async def _stream_one(
        self, held: Held, out: asyncio.Queue[Any], forwarded: forwarding.Headers = ()
    ) -> None:
        """One stream request -> its responses, put on ``out`` then ``None``, through the
        one exchange (:func:`exchange.serve_stream`: its hold released once they are
        all on ``out``). A failure becomes ``error_message`` so the stream goes on
        (Triton's behaviour).

        A decoupled model's responses each carry ``triton_final_response`` (true on
        the last); a final flag sent without a response is answered with an empty
        response only when the request sets ``triton_enable_empty_final_response``
        (as Triton). A regular model's one response carries the flag only then.
        """
        request, hold = held
        try:
            if isinstance(request, (grpc_wire.Undecodable, calls.Refused)):
                # a message that did not parse, or was refused before it was kept (its
                # queued bytes did not fit): answered in the stream, which goes on
                out.put_nowait(
                    service_pb2.ModelStreamInferResponse(error_message=request.error.message)
                )
                return
            empty_final = codec.param(
                request.parameters, "triton_enable_empty_final_response", "bool_param", "request"
            )
            size = hold.nbytes if hold is not None else _declared_bytes(request)
            payload = (request, forwarded)
            answers = exchange.serve_stream(self.dp, STREAM_INFER, payload, size, hold)
            async for item, final, decoupled in answers:
                if isinstance(item, ApplianceError):
                    out.put_nowait(self._stream_error(request, item.message))
                    continue
                if decoupled and final and not item.outputs and not empty_final:
                    continue  # only the final flag, and the client did not ask for it
                if decoupled or empty_final:
                    item.parameters["triton_final_response"].bool_param = final
                out.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=item))
        except ApplianceError as exc:
            out.put_nowait(self._stream_error(request, exc.message))
        except Exception as exc:  # a bug: report it in-stream and keep serving
            log.exception("unhandled error in gRPC ModelStreamInfer")
            out.put_nowait(self._stream_error(request, f"internal error: {exc}"))
        finally:
            out.put_nowait(None)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Bidirectional stream: requests run concurrently (up to ``STREAM_WINDOW``), and
        responses go back grouped by request, in request order.

        A reader task takes requests off the stream and starts one task per request,
        which puts that request's responses (one, or 0..N for a decoupled model) on a
        queue of its own; this generator drains the queues in request order. The
        window semaphore is released by this generator once a request's responses are
        all sent, so a slow model stops the reading, not the memory. When the call
        ends (the client cancels, or the server stops after its grace), the reader
        and every running task are cancelled.
        """
        window = asyncio.Semaphore(STREAM_WINDOW)
        forwarded = self._forwarded(context)  # the stream's headers, for each request
        pending: asyncio.Queue[tuple[asyncio.Task[None], asyncio.Queue[Any]] | None]
        pending = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        held: list[Hold] = []  # the hold of a request read, not yet given to a task

        async def read() -> None:
            try:
                async for request in request_iterator:
                    hold = request.hold
                    if hold is not None:  # given back however the request ends
                        held.append(hold)
                    await window.acquire()
                    out: asyncio.Queue[Any] = asyncio.Queue()
                    task = asyncio.create_task(self._stream_one(request, out, forwarded))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    if hold is not None:  # (the exchange releases it; this, a task
                        held.pop()  # cancelled before it started)
                        task.add_done_callback(_releasing(hold))
                    pending.put_nowait((task, out))
            finally:
                pending.put_nowait(None)  # unbounded queue: never blocks

        reader = asyncio.create_task(read())  # referenced until the finally below
        try:
            while (entry := await pending.get()) is not None:
                _, out = entry
                while (response := await out.get()) is not None:
                    yield response
                window.release()
            await reader  # re-raises a broken read
        finally:
            reader.cancel()
            # a read that broke after this generator stopped must not log "never retrieved"
            reader.add_done_callback(lambda t: t.cancelled() or t.exception())
            for task in list(running):
                task.cancel()
            for hold in held:
                hold.release()

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
