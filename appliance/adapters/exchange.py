"""One inference exchange for every wire: admit -> read the form -> declare -> build ->
infer -> encode -> deliver -> release.

HTTP (:mod:`appliance.adapters.http.infer`, both fronts), gRPC unary and streaming
(:mod:`appliance.adapters.grpc.api`), MQTT (:mod:`appliance.adapters.mqtt.codec`) and
the in-process API (:mod:`appliance.adapters.inprocess`) each supply a :class:`Wire`:
a form reader (their payload -> :class:`~appliance.adapters.request_form.RequestForm`,
no tensor decoded) and an encoder (an
:class:`~appliance.request.InferenceResponse` -> their answer). Everything else is
here, once:

- **admission**: the wire admits before it has the payload when the request names its
  model outside it (HTTP's path, MQTT's topic: :meth:`DataPlane.admit` with the
  declared size) and passes the ticket; a wire whose model is inside the payload
  (gRPC) passes the hold it took from the message's length prefix
  (:meth:`DataPlane.reserve`), and the form's model is admitted here with it;
- **one offload rule** (the constants in :mod:`appliance.adapters.offload`): a payload
  of more than ``OFFLOAD_BYTES`` is read, declared and built on a worker thread, in
  one hop; a smaller one on the event loop, but built on a worker thread when it holds
  more than ``LOOP_OBJECTS`` BYTES elements or names a file on the device. An answer
  is encoded on a worker thread when it writes more than ``OFFLOAD_BYTES`` of text
  (JSON numbers), copies more than ``OFFLOAD_COPY_BYTES`` (into shared memory, or raw
  outputs a wire joins into one buffer) or holds more than ``LOOP_OBJECTS`` BYTES
  elements;
- **one release point**: the request's hold on the queued bytes is released after the
  wire has delivered the answer (``deliver``: written, published, queued on its
  stream) or the exchange failed (the answer is an error then, or dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import numpy as np

from appliance.adapters import request_form
from appliance.adapters.offload import LOOP_OBJECTS, OFFLOAD_BYTES, OFFLOAD_COPY_BYTES
from appliance.adapters.request_form import OutputFormat, RequestForm
from appliance.core.admission import Ticket
from appliance.core.dataplane import DataPlane
from appliance.core.queue_bytes import Hold
from appliance.core.servable import Servable
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError
from appliance.request import InferenceRequest, InferenceResponse

A = TypeVar("A")
# a plain payload read by its version's plan before admission (:meth:`Wire.plan`): the
# version, the request, its output format, its element count
Planned = tuple[Servable, InferenceRequest, OutputFormat, int]


class Dropped(Exception):
    """The wire dropped the request before inference (:meth:`Wire.proceed`): no answer."""


class Wire(Generic[A]):
    """What a wire supplies: its form reader and its encoder (both may run on a worker
    thread, and must not touch the event loop)."""

    endpoint = "this endpoint"  # named in the refusal of a decoupled model
    # outputs not asked for in binary are written as text, number by number (KServe
    # JSON: HTTP, MQTT); else every output is raw bytes (gRPC)
    text = False
    # the wire copies raw outputs into one buffer of its own (gRPC's message, an MQTT
    # payload) rather than writing views of them (HTTP)
    joins = False
    # the wire answers once: a decoupled model's responses are joined into one answer
    # (MQTT: a language model's final text) instead of refused
    answers_once = False

    def read(self, payload: Any, ticket: Ticket | None) -> RequestForm:
        """The payload -> the request form, no tensor decoded (INVALID_ARG for what is
        malformed). ``ticket``: the admission when it came first (None for gRPC)."""
        raise NotImplementedError

    def proceed(self, payload: Any, request: InferenceRequest) -> bool:
        """A last look at the built request, on the event loop, before inference (MQTT:
        de-duplication by request id, the message's expiry): False drops it, and
        :func:`serve` raises :class:`Dropped`."""
        return True

    def quick(
        self, payload: Any, ticket: Ticket
    ) -> tuple[InferenceRequest, OutputFormat] | None:
        """A plain payload read straight into its request, its inputs declared to
        ``ticket`` (a wire's fast case, on the event loop); None: read it the general
        way (:meth:`read`, then the form's declare and build), which decides."""
        return None

    def plan(
        self, payload: Any, serving: Callable[[str, str], Servable | None], max_elements: int
    ) -> Planned | None:
        """A plain payload that names its model (gRPC's message) and holds at most
        ``max_elements``, read straight into its request by the plan of the version
        ``serving`` gives for that name, before it is admitted (a wire's fast case, on
        the event loop): (that version, the request, its format, its element count),
        or None: read it the general way (:meth:`read`), which decides."""
        return None

    def build(self, form: RequestForm, shm: SharedMemoryRegistry) -> InferenceRequest:
        """The declared form -> the request (a wire with files to read overrides it)."""
        return request_form.build(form, shm)

    def encode(self, response: InferenceResponse, fmt: OutputFormat, shm: Any) -> A:
        raise NotImplementedError


async def serve(
    dataplane: DataPlane,
    wire: Wire[A],
    payload: Any,
    size: int,
    ticket: Ticket | None = None,
    hold: Hold | None = None,
    deliver: Callable[[A], None] | None = None,
) -> A:
    """One request, one answer. ``size``: the bytes :meth:`Wire.read` parses (the
    offload rule's measure); ``ticket``: the admission the wire took before the
    payload arrived; else ``hold``: the queued bytes held for the payload, and the
    form's model is admitted here. ``deliver``: hands the answer to the wire (write,
    publish) before the hold is released; the answer is returned too. Raises
    :class:`ApplianceError` (the hold released) for the wire to map, or
    :class:`Dropped`."""
    try:
        shm = dataplane.shared_memory
        ticket, request, fmt = await _decode(dataplane, wire, payload, size, ticket, hold)
        if not wire.proceed(payload, request):
            raise Dropped
        if wire.answers_once and ticket.servable.config.decoupled:
            response = await dataplane.infer_final(request, ticket)
        else:
            response = await dataplane.infer(request, wire.endpoint, ticket)
        answer = await _encode(wire, response, fmt, shm)
        if deliver is not None:
            deliver(answer)
        return answer
    finally:
        _release(ticket, hold)


async def serve_stream(
    dataplane: DataPlane,
    wire: Wire[A],
    payload: Any,
    size: int,
    hold: Hold | None = None,
) -> AsyncIterator[tuple[A | ApplianceError, bool, bool]]:
    """The answers of one streamed request, each with its "final" flag and whether the
    model is decoupled (which sends 0..N, the last flagged final, maybe empty); an
    error the model sent comes as an :class:`ApplianceError` item and the stream goes
    on. The hold is released once the caller has taken the last one (or stopped). As
    :func:`serve` otherwise."""
    ticket = None
    try:
        ticket, request, fmt = await _decode(dataplane, wire, payload, size, None, hold)
        shm = dataplane.shared_memory
        decoupled = ticket.servable.config.decoupled
        async for item, final in dataplane.infer_stream(request, ticket):
            if isinstance(item, ApplianceError):
                yield item, final, decoupled
            else:
                answer: A = await _encode(wire, item, fmt, shm)
                yield answer, final, decoupled
    finally:
        _release(ticket, hold)


def _release(ticket: Ticket | None, hold: Hold | None) -> None:
    """The one release point (a ticket admitted with ``hold`` holds that hold)."""
    if ticket is not None:
        ticket.release()
    if hold is not None:
        hold.release()


async def _decode(
    dataplane: DataPlane,
    wire: Wire[Any],
    payload: Any,
    size: int,
    ticket: Ticket | None,
    hold: Hold | None,
) -> tuple[Ticket, InferenceRequest, OutputFormat]:
    shm = dataplane.shared_memory
    heavy = size > OFFLOAD_BYTES
    if ticket is None:  # the model is in the payload: read it, then admit its model
        if heavy:
            form = await asyncio.to_thread(wire.read, payload, None)
        else:
            limit = dataplane.lifecycle.server.max_request_elements
            planned = wire.plan(payload, dataplane.serving, limit)
            if planned is not None:  # plain: admitted as the general reader's would be
                servable, request, fmt, elements = planned
                ticket = dataplane.admit(
                    request.model_name, request.model_version, held=hold, servable=servable
                )
                ticket.planned(elements)
                return ticket, request, fmt
            form = wire.read(payload, None)
        ticket = dataplane.admit(form.model, form.version, held=hold)
        try:  # the caller never sees this ticket when the request fails here
            if heavy:
                request = await asyncio.to_thread(_declared, wire, form, ticket, shm)
            else:
                request = await _built(wire, form, ticket, shm)
        except BaseException:
            ticket.release()  # what declare() held (shared-memory regions) with it
            raise
        return ticket, request, form.fmt
    if heavy:
        form, request = await asyncio.to_thread(_read_declared, wire, payload, ticket, shm)
        return ticket, request, form.fmt
    quick = wire.quick(payload, ticket)
    if quick is not None:
        return ticket, *quick
    form = wire.read(payload, ticket)
    return ticket, await _built(wire, form, ticket, shm), form.fmt


async def _built(
    wire: Wire[Any], form: RequestForm, ticket: Ticket, shm: SharedMemoryRegistry
) -> InferenceRequest:
    request_form.declare(form, ticket, shm)
    if form.object_elements > LOOP_OBJECTS or form.files:
        return await asyncio.to_thread(wire.build, form, shm)
    return wire.build(form, shm)


def _declared(
    wire: Wire[Any], form: RequestForm, ticket: Ticket, shm: SharedMemoryRegistry
) -> InferenceRequest:
    request_form.declare(form, ticket, shm)
    return wire.build(form, shm)


def _read_declared(
    wire: Wire[Any], payload: Any, ticket: Ticket, shm: SharedMemoryRegistry
) -> tuple[RequestForm, InferenceRequest]:
    form = wire.read(payload, ticket)
    return form, _declared(wire, form, ticket, shm)


async def _encode(wire: Wire[A], response: InferenceResponse, fmt: OutputFormat, shm: Any) -> A:
    if heavy_answer(response.outputs, fmt, wire):
        return await asyncio.to_thread(wire.encode, response, fmt, shm)
    return wire.encode(response, fmt, shm)


def heavy_answer(outputs: dict[str, np.ndarray], fmt: OutputFormat, wire: Wire[Any]) -> bool:
    """Whether encoding ``outputs`` for ``wire`` belongs on a worker thread (the offload
    rule)."""
    text_bytes = copy_bytes = objects = 0
    for name, arr in outputs.items():
        if name in fmt.shared_memory:
            copy_bytes += arr.nbytes
        elif wire.text and not fmt.is_binary(name):
            text_bytes += arr.nbytes
        elif wire.joins:
            copy_bytes += arr.nbytes
        if arr.dtype.kind in "OUS":  # BYTES: serialized element by element
            objects += arr.size
    return text_bytes > OFFLOAD_BYTES or copy_bytes > OFFLOAD_COPY_BYTES or objects > LOOP_OBJECTS
