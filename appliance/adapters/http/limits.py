"""What the HTTP endpoint takes from a peer: body sizes and how long a peer may take.

- A declared ``Content-Length`` above ``max_request_size`` is answered 413 at once,
  before any byte of the body is read; with ``Expect: 100-continue`` the 413 goes
  instead of the ``100 Continue``, so a well-behaved client never sends the body.
  (A chunked body is cut off by aiohttp's ``client_max_size`` at the same limit.)
- A request header must be complete within ``http_header_timeout_s`` of the
  connection opening or of the previous response; an idle keep-alive connection
  is closed after the same time. This is aiohttp's keep-alive timer, which (since
  aiohttp 3.14.4, hence the requirement) runs from the connection's start and closes
  a connection still waiting for a complete request when it fires.
- A request body must be complete within ``http_body_timeout_s``; a slower one is
  answered 408 and the connection closed. aiohttp then reads what the client still
  sends for at most the same time ("lingering", so the client sees the answer)
  before it closes.

:mod:`appliance.adapters.http.front` applies the same limits, with the same answers,
to the inference requests it serves itself (its connections never reach aiohttp).

Protocol-specific by nature, so it lives next to the adapter; the limits
themselves are plain server-config numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11

from appliance.adapters.codec.kserve import error_body
from appliance.adapters.http.routing import Shape
from appliance.config.server_config import ServerConfig

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp's own lingering default: longer gives a slow client nothing
_MAX_LINGER_S = 10.0
# the body once read, and how long reading it may take (set by BodyLimits.refuse)
_BODY: web.RequestKey[bytes | bytearray] = web.RequestKey("appliance.body")
_BODY_TIMEOUT: web.RequestKey[float] = web.RequestKey("appliance.body_timeout_s")
_YIELD_BYTES = 2**20  # bytes copied between two turns of the event loop


def runner_options(config: ServerConfig) -> dict[str, Any]:
    """Keyword arguments of ``web.AppRunner`` (they reach aiohttp's request handler)."""
    return {
        "keepalive_timeout": config.http_header_timeout_s,
        "lingering_time": min(_MAX_LINGER_S, config.http_body_timeout_s),
    }


def _refusal(status: int, message: str, shape: Shape | None = None) -> web.Response:
    body = shape(status, message) if shape is not None else error_body(message)
    response = web.Response(body=body, status=status, content_type="application/json")
    response.force_close()  # the rest of this connection's bytes are not worth reading
    return response


def _too_large(request: web.Request, limit: int, shape: Shape | None) -> web.Response | None:
    declared = request.content_length
    if declared is None or declared <= limit:
        return None
    return _refusal(
        413,
        f"request body of {declared} bytes (Content-Length) exceeds the server's limit of "
        f"{limit} bytes (max_request_size)",
        shape,
    )


def expect_handler(
    limit: int, shape_of: Callable[[web.Request], Shape | None] = lambda _: None
) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """An ``Expect: 100-continue`` handler that refuses an oversized body before the
    client sends it, instead of inviting it (``shape_of``: the route's error shape)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        refusal = _too_large(request, limit, shape_of(request))
        if refusal is not None:
            return refusal
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _refusal(
                417, f"unsupported Expect: {request.headers.get('Expect')!r}", shape_of(request)
            )
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not part of the response
        return None

    return expect


async def _read(request: web.Request) -> bytes | bytearray:
    """The whole body. With a declared length: into one buffer of that size, each
    received chunk copied once (``request.read()`` grows a buffer and then copies all
    of it again: a 60 MB body held the event loop for a fifth of a second)."""
    length = request.content_length
    if length is None:  # chunked: aiohttp stops it at client_max_size
        return await request.read()
    buffer = bytearray(length)
    view = memoryview(buffer)
    filled = since_yield = 0
    while filled < length:
        chunk = await request.content.readany()  # suspends only when nothing is buffered
        if not chunk:
            raise ConnectionResetError(f"the body ended after {filled} of {length} bytes")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
        since_yield += len(chunk)
        if since_yield >= _YIELD_BYTES:  # a fast sender's 60 MB, all buffered: take turns
            since_yield = 0
            await asyncio.sleep(0)
    return buffer


class BodyTimeout(Exception):
    """The body did not arrive in time: :meth:`BodyLimits.timed_out` answers 408."""


async def body(request: web.Request) -> bytes | bytearray:
    """The request body (b"" if none), read on the first call within the body timeout.

    Read by the handler, not up front, so a handler can refuse before the payload
    is in memory (an overloaded model's 503: appliance.core.queue_bytes)."""
    cached = request.get(_BODY)
    if isinstance(cached, (bytes, bytearray)):
        return cached
    if not request.body_exists:
        return b""
    data: bytes | bytearray
    if request.content.is_eof() and request.content.total_bytes <= _YIELD_BYTES:
        # a small body that arrived with its headers (the common case): all of it is
        # buffered, so no timer and no task are needed to read it
        data = await request.read()
    else:
        timeout: float | None = request.get(_BODY_TIMEOUT) or None
        try:
            data = await asyncio.wait_for(_read(request), timeout)
        except asyncio.TimeoutError:
            raise BodyTimeout(timeout) from None
    request[_BODY] = data
    return data


class BodyLimits:
    """The body rules of every request, applied by the HTTP front middleware: refuse
    an oversized declared body (413) at once (:meth:`refuse`); a body that a handler
    reads (:func:`body`) must arrive within ``body_timeout_s``, else :class:`BodyTimeout`
    is raised and answered 408 (:meth:`timed_out`)."""

    __slots__ = ("body_timeout_s", "limit")

    def __init__(self, limit: int, body_timeout_s: float) -> None:
        self.limit = limit
        self.body_timeout_s = body_timeout_s

    def refuse(self, request: web.Request, shape: Shape | None = None) -> web.Response | None:
        refusal = _too_large(request, self.limit, shape)
        if refusal is None:
            request[_BODY_TIMEOUT] = self.body_timeout_s
        return refusal

    def timed_out(self, request: web.Request, shape: Shape | None = None) -> web.Response:
        log.debug("body from %s not complete in %.1fs", request.remote, self.body_timeout_s)
        return _refusal(
            408,
            f"the request body did not arrive within {self.body_timeout_s:g}s "
            f"(http_body_timeout_s)",
            shape,
        )
