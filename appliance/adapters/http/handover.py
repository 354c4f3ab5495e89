"""A connection handed over to aiohttp (:func:`hand_over`): when
:mod:`appliance.adapters.http.front` meets a request it does not serve itself, aiohttp's
request handler takes the connection for good, from that request's first byte on, as
if it had accepted the connection.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from appliance.adapters.http import head as http_head


def hand_over(
    transport: asyncio.Transport, handler: web.RequestHandler, data: bytes, paused: bool
) -> None:
    """``handler`` serves ``transport`` from now on, starting with ``data`` (what was
    received and not served: the current request's first byte on); ``paused``: the
    front had paused reading."""
    transport.set_protocol(handler)
    handler.connection_made(transport)
    if paused:  # (paused only while busy or not written to: never here)
        transport.resume_reading()
    end = data.find(b"\r\n\r\n", 0, http_head.MAX_HEAD)
    if end >= 0:  # a chunked body with a Content-Length too: by the chunks alone
        rewritten = http_head.chunked_only(data[: end + 4])
        if rewritten is not None:
            data = rewritten + data[end + 4 :]
    if data:
        handler.data_received(data)
