"""One KServe v2 HTTP inference, from its body to its answer: the part both HTTP
fronts share (:mod:`appliance.adapters.http_front`, which serves the two inference
routes itself, and the aiohttp route in :mod:`appliance.adapters.http_api`).

The caller admits the request first (:meth:`DataPlane.admit`, before the body is in
memory) and releases the ticket after; this module decodes the body once against
that ticket, infers, and encodes once, applying the offload rule
(:mod:`appliance.adapters.offload`) inline: big or object-heavy codec work goes to
a worker thread, the rest runs on the event loop without a coroutine of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from appliance.adapters import http_codec, offload, request_form
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.errors import Code

# ApplianceError codes -> HTTP statuses, as Triton answers them
STATUS = {
    Code.INVALID_ARG: 400,
    Code.NOT_FOUND: 404,
    Code.UNAVAILABLE: 503,
    Code.TOO_LARGE: 413,
    Code.INTERNAL: 500,
}

JSON = "application/json"
BINARY = "application/octet-stream"


async def answer(
    dataplane: DataPlane,
    ticket: Ticket,
    model: str,
    version: str,
    body: bytes | bytearray,
    header_length_field: str | None,
) -> tuple[list[bytes | memoryview], int | None]:
    """``body`` (with its ``Inference-Header-Content-Length`` field, if any) ->
    (the response body's parts, the JSON header's length when binary outputs
    follow, else None). Raises :class:`ApplianceError` for the caller to map."""
    shm = dataplane.shared_memory
    header_length = http_codec.parse_header_length(header_length_field, len(body))
    json_bytes = len(body) if header_length is None else header_length
    if json_bytes > offload.OFFLOAD_BYTES:
        inference, fmt = await asyncio.to_thread(
            http_codec.decode_request, body, header_length, model, version, shm, ticket
        )
    else:
        form = http_codec.parse_request(body, header_length, model, version)
        # every declaration checked against the model before any data is decoded
        request_form.declare(form, ticket, shm)
        fmt = form.fmt
        if form.object_elements > offload.LOOP_OBJECTS:
            inference = await asyncio.to_thread(request_form.build, form, shm)
        else:
            inference = request_form.build(form, shm)
    response = await dataplane.infer(inference, "HTTP end point", ticket)
    if _heavy_response(response.outputs, fmt):
        return await asyncio.to_thread(http_codec.encode_parts, response, fmt, shm)
    return http_codec.encode_parts(response, fmt, shm)


def _heavy_response(outputs: dict[str, Any], fmt: request_form.OutputFormat) -> bool:
    """Whether encoding ``outputs`` belongs on a worker thread (the offload rule)."""
    text_bytes = copy_bytes = objects = 0
    for name, arr in outputs.items():
        if name in fmt.shared_memory:
            copy_bytes += arr.nbytes
        elif not fmt.is_binary(name):
            text_bytes += arr.nbytes
        if arr.dtype.kind in "OUS":  # BYTES: serialized element by element
            objects += arr.size
    return (
        text_bytes > offload.OFFLOAD_BYTES
        or copy_bytes > offload.OFFLOAD_COPY_BYTES
        or objects > offload.LOOP_OBJECTS
    )
