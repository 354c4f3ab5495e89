"""One KServe v2 HTTP inference, from its body to its answer: the HTTP wire of the one
exchange (:mod:`appliance.adapters.exchange`), which both HTTP fronts use
(:mod:`appliance.adapters.http.front`, which serves the two inference routes itself,
and the aiohttp route in :mod:`appliance.adapters.http.api`).

The caller admits the request first (:meth:`DataPlane.admit`, before the body is in
memory) and hands the ticket over; the exchange decodes the body once against it,
infers, encodes once and releases the ticket after ``deliver`` wrote the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from appliance.adapters import exchange, forwarding
from appliance.adapters.codec import kserve, kserve_plan
from appliance.adapters.request_form import OutputFormat, RequestForm
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.errors import Code
from appliance.request import InferenceRequest, InferenceResponse

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

# the response body's parts, and the JSON header's length when binary outputs follow
Answer = tuple[list[bytes | memoryview], int | None]


class _HttpWire(exchange.Wire[Answer]):
    """A body (JSON, or Triton's binary extension) -> the form; an answer -> its parts
    (the JSON header, then views of the binary outputs: written as they are)."""

    endpoint = "HTTP end point"
    text = True

    def read(self, payload: Any, ticket: Ticket | None) -> RequestForm:
        body, field, model, version, forwarded = payload
        header_length = kserve.parse_header_length(field, len(body))
        form = kserve.parse_request(body, header_length, model, version)
        if forwarded:
            forwarding.apply(form, forwarded)
        return form

    def quick(self, payload: Any, ticket: Ticket) -> tuple[InferenceRequest, OutputFormat] | None:
        """A plain binary request (:mod:`appliance.adapters.codec.kserve_plan`)."""
        body, field, model, version, forwarded = payload
        if forwarded or field is None or not (field.isascii() and field.isdigit()):
            return None
        plan = kserve_plan.plan_of(ticket.servable)
        if plan is None or len(field) > 19:
            return None
        return plan.read(body, int(field), ticket, model, version)

    def encode(self, response: InferenceResponse, fmt: OutputFormat, shm: Any) -> Answer:
        return kserve.encode_parts(response, fmt, shm)


HTTP = _HttpWire()


def json_size(body: bytes | bytearray, header_length_field: str | None) -> int:
    """The bytes of ``body`` the JSON parser reads (the offload rule's measure); the
    field is checked strictly when the form is read."""
    field = header_length_field
    if field is not None and field.isascii() and field.isdigit() and len(field) <= 19:
        return min(int(field), len(body))
    return len(body)


async def answer(
    dataplane: DataPlane,
    ticket: Ticket,
    model: str,
    version: str,
    body: bytes | bytearray,
    header_length_field: str | None,
    deliver: Callable[[Answer], None] | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> Answer:
    """``body`` (with its ``Inference-Header-Content-Length`` field, if any) ->
    (the response body's parts, the JSON header's length when binary outputs
    follow, else None), handed to ``deliver`` before ``ticket`` is released; the
    ``headers`` the server forwards as parameters join the request's. Raises
    :class:`ApplianceError` (the ticket released) for the caller to map."""
    pattern = dataplane.lifecycle.server.http_header_forward_pattern
    forwarded = forwarding.select(headers, pattern) if pattern else ()
    payload = (body, header_length_field, model, version, forwarded)
    size = json_size(body, header_length_field)
    return await exchange.serve(dataplane, HTTP, payload, size, ticket=ticket, deliver=deliver)
