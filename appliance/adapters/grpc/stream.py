"""gRPC ``ModelStreamInfer``: a bidirectional stream of inference requests and their
responses (:func:`serve`), each request through the one exchange
(:func:`appliance.adapters.exchange.serve_stream`).

As in Triton, a regular model's responses go back in request order, and a decoupled
model's each as soon as it comes, interleaved with the others; errors travel in the
stream as ``error_message`` and the stream goes on; ``STREAM_WINDOW`` requests at most
are answered at once, released as their responses are sent.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from tritonclient.grpc import service_pb2

from appliance import datatypes
from appliance.adapters import exchange, forwarding, request_form
from appliance.adapters.codec import kserve_plan
from appliance.adapters.grpc import calls, codec
from appliance.adapters.grpc import wire as grpc_wire
from appliance.adapters.grpc.calls import Held
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.core.queue_bytes import Hold
from appliance.core.servable import Servable
from appliance.errors import ApplianceError
from appliance.request import InferenceResponse

log = logging.getLogger(__name__)

# requests of one stream in flight at once; past it the stream is not read further
# (gRPC flow control then holds the client back)
STREAM_WINDOW = 64


def _declared_bytes(request: Any) -> int:
    """What the request's inputs claim to weigh (BYTES counted as one byte an element)."""
    total = 0
    for tensor in request.inputs:
        known = tensor.datatype in datatypes.DATATYPES
        itemsize = datatypes.byte_size(tensor.datatype, [1]) if known else None
        total += math.prod(tensor.shape) * (itemsize or 1)
    return total


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

    def plan(
        self, payload: Any, serving: Callable[[str, str], Servable | None], max_elements: int
    ) -> exchange.Planned | None:
        """A plain message, as ModelInfer's wire plans it (the stream reads
        ``triton_enable_empty_final_response`` from the message itself)."""
        message, forwarded = payload
        if forwarded:
            return None
        return kserve_plan.plan_message(message, serving, max_elements)

    def encode(self, response: InferenceResponse, fmt: Any, shm: Any) -> Any:
        return codec.encode_response(response, fmt.shared_memory, shm)


STREAM_INFER = _StreamWire()


# on the stream's queue after a request's last response: its place in the window is
# given back once what came before it was sent
_SENT = object()


class _Direct:
    """Where a decoupled request's responses go: straight onto the stream's queue, its
    end (``None``) as :data:`_SENT`."""

    __slots__ = ("_ready",)

    def __init__(self, ready: asyncio.Queue[Any]) -> None:
        self._ready = ready

    def put_nowait(self, item: Any) -> None:
        self._ready.put_nowait(_SENT if item is None else item)


def _passing(turn: asyncio.Future[None]) -> Callable[[Any], None]:
    """A done callback: the next regular request of the stream may queue its response."""

    def done(_: Any) -> None:
        if not turn.done():
            turn.set_result(None)

    return done


def _releasing(hold: Hold) -> Callable[[Any], None]:
    """A task's done callback that gives ``hold`` back."""
    return lambda _: hold.release()


def _stream_error(request: Any, message: str) -> Any:
    echo = service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=echo)


async def _stream_one(
    dp: DataPlane, held: Held, out: Any, forwarded: forwarding.Headers = ()
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
        answers = exchange.serve_stream(dp, STREAM_INFER, payload, size, hold)
        async for item, final, decoupled in answers:
            if isinstance(item, ApplianceError):
                out.put_nowait(_stream_error(request, item.message))
                continue
            if decoupled and final and not item.outputs and not empty_final:
                continue  # only the final flag, and the client did not ask for it
            if decoupled or empty_final:
                item.parameters["triton_final_response"].bool_param = final
            out.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=item))
    except ApplianceError as exc:
        out.put_nowait(_stream_error(request, exc.message))
    except Exception as exc:  # a bug: report it in-stream and keep serving
        log.exception("unhandled error in gRPC ModelStreamInfer")
        out.put_nowait(_stream_error(request, f"internal error: {exc}"))
    finally:
        out.put_nowait(None)


def _decoupled(dp: DataPlane, message: Any) -> bool:
    """Whether a stream request goes to a decoupled model (False when it does not
    name a model that serves: its error keeps the request order)."""
    try:
        servable = dp.lifecycle.get(message.model_name, message.model_version)
    except (ApplianceError, AttributeError):
        return False
    return bool(servable.config.decoupled)


async def serve(
    dp: DataPlane, request_iterator: Any, forwarded: forwarding.Headers = ()
) -> AsyncIterator[Any]:
    """Bidirectional stream: requests run concurrently (up to ``STREAM_WINDOW``).
    As in Triton, a regular model's responses go back in request order, and a
    decoupled model's each as soon as it comes (interleaved with the others).

    A reader task takes requests off the stream and starts one task per request,
    which puts that request's responses (one, or 0..N for a decoupled model) on the
    stream's queue, which this generator sends: a decoupled request's as they come,
    a regular one's once the regular request read before it queued its own. The
    window semaphore is released once a request's responses are all sent, so a slow
    model or a client that does not read stops the reading, not the memory. When
    the call ends (the client cancels, or the server stops after its grace), the
    reader and every running task are cancelled.
    """
    window = asyncio.Semaphore(STREAM_WINDOW)
    ready: asyncio.Queue[Any] = asyncio.Queue()  # to send, in this order
    running: set[asyncio.Task[None]] = set()
    held: list[Hold] = []  # the hold of a request read, not yet given to a task
    started = 0  # requests read; each ends with one _SENT on ``ready``
    turn: asyncio.Future[None] | None = None  # done once the last regular one queued

    async def regular(request: Held, before: asyncio.Future[None] | None) -> None:
        """A regular model's request: its response queued to send after those of
        the regular requests read before it (request order, as Triton)."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        try:
            await _stream_one(dp, request, out, forwarded)
            if before is not None:
                await before
            while (response := out.get_nowait()) is not None:
                ready.put_nowait(response)
        finally:
            ready.put_nowait(_SENT)

    async def read() -> None:
        nonlocal started, turn
        try:
            async for request in request_iterator:
                hold = request.hold
                if hold is not None:  # given back however the request ends
                    held.append(hold)
                await window.acquire()
                if _decoupled(dp, request.request):  # each response as it comes
                    call = _stream_one(dp, request, _Direct(ready), forwarded)
                    task = asyncio.create_task(call)
                else:
                    task = asyncio.create_task(regular(request, turn))
                    turn = asyncio.get_running_loop().create_future()
                    task.add_done_callback(_passing(turn))
                started += 1
                running.add(task)
                task.add_done_callback(running.discard)
                if hold is not None:  # (the exchange releases it; this, a task
                    held.pop()  # cancelled before it started)
                    task.add_done_callback(_releasing(hold))
        finally:
            ready.put_nowait(None)  # unbounded queue: never blocks

    reader = asyncio.create_task(read())  # referenced until the finally below
    try:
        read_all, sent = False, 0
        while not (read_all and sent == started):
            response = await ready.get()
            if response is None:
                read_all = True
            elif response is _SENT:
                sent += 1
                window.release()
            else:
                yield response
        await reader  # re-raises a broken read
    finally:
        reader.cancel()
        # a read that broke after this generator stopped must not log "never retrieved"
        reader.add_done_callback(lambda t: t.cancelled() or t.exception())
        for task in list(running):
            task.cancel()
        for hold in held:
            hold.release()
