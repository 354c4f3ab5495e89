"""One text request's responses on HTTP: Server-Sent Events, and the one answer.

The generate extension (:mod:`appliance.adapters.http.generate`) and the OpenAI API
(:mod:`appliance.adapters.http.openai`) both admit a request, send it through
:meth:`DataPlane.infer_stream <appliance.core.dataplane.DataPlane.infer_stream>` and
either stream each response as an SSE ``data:`` event or wait for the one answer.
What they share is here: taking the request's inputs to the ticket, iterating the
responses so that a caller who goes away cancels the generation (the iterator is
closed, the data plane tells the model), and writing events.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import numpy as np
from aiohttp import web

from appliance import datatypes
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.errors import ApplianceError
from appliance.request import InferenceRequest, InferenceResponse

log = logging.getLogger(__name__)

EVENT_STREAM = "text/event-stream"
# the errors a client that left raises while its response is written
GONE = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def declare(ticket: Ticket, inputs: dict[str, np.ndarray]) -> None:
    """Declare the request's inputs (built from a small JSON body, whole) to its ticket:
    the model's rules and the server's element limit, once."""
    for name, arr in inputs.items():
        ticket.declare(name, datatypes.from_numpy_dtype(arr.dtype), arr.shape)
    ticket.declared = True


async def responses(
    dataplane: DataPlane, request: InferenceRequest, ticket: Ticket
) -> AsyncGenerator[InferenceResponse | ApplianceError]:
    """The request's responses that carry outputs (a final flag alone is left out) or
    an error. Closing this iterator early (the caller left) cancels the request."""
    stream = dataplane.infer_stream(request, ticket)
    try:
        async for item, _final in stream:
            if isinstance(item, ApplianceError) or item.outputs:
                yield item
    finally:
        await stream.aclose()


async def open_events(request: web.Request, status: int = 200) -> web.StreamResponse:
    """An SSE response, its head written."""
    response = web.StreamResponse(status=status)
    response.content_type = EVENT_STREAM
    response.charset = "utf-8"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    return response


async def event(response: web.StreamResponse, data: bytes) -> None:
    """One ``data:`` event (``data`` is one line of JSON, or ``[DONE]``)."""
    await response.write(b"data: " + data + b"\n\n")


def client_left(request: web.Request) -> bool:
    """Whether the connection of ``request`` is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()
