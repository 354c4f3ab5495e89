"""A connection handed over to aiohttp (:func:`hand_over`): when
:mod:`appliance.adapters.http.front` meets a request it does not serve itself, aiohttp's
request handler takes the connection for good, from that request's first byte on, as
if it had accepted the connection. Until the application behind the front is set up
(:mod:`appliance.adapters.http.backstage`, on first need), the connection is held by
:class:`_Waiting`: not read, what was already received kept, and closed if the set-up
fails.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from appliance.adapters.http import head as http_head
from appliance.adapters.http.backstage import Backstage

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)


def hand_over(transport: asyncio.Transport, backstage: Backstage, data: bytes) -> None:
    """aiohttp serves ``transport`` from now on, starting with ``data`` (what was
    received and not served: the current request's first byte on), at once when the
    backstage is up, else once it is."""
    server = backstage.server
    if server is not None:
        _give(transport, server, data)
        return
    waiting = _Waiting(transport, data)
    transport.set_protocol(waiting)
    transport.pause_reading()
    waiting.task = asyncio.get_running_loop().create_task(waiting.wait(backstage))


class _Waiting(asyncio.Protocol):
    """A connection whose aiohttp handler is being set up."""

    def __init__(self, transport: asyncio.Transport, data: bytes) -> None:
        self.transport: asyncio.Transport | None = transport
        self.data = bytearray(data)
        self.task: asyncio.Task[None] | None = None

    def data_received(self, data: bytes) -> None:  # (a read begun before the pause)
        self.data += data

    def eof_received(self) -> bool:
        return True  # half-closed: its request still gets an answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    async def wait(self, backstage: Backstage) -> None:
        try:
            server = await backstage.start()
        except BaseException as exc:  # (cancelled too: shutting down, or the client left)
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("the HTTP routes behind the front could not be set up")
            if self.transport is not None:
                self.transport.close()
            if isinstance(exc, Exception):
                return
            raise
        if self.transport is not None:
            _give(self.transport, server, bytes(self.data))


def _give(transport: asyncio.Transport, server: web.Server, data: bytes) -> None:
    handler = server()
    transport.set_protocol(handler)
    handler.connection_made(transport)
    transport.resume_reading()  # (a no-op where reading was not paused)
    end = data.find(b"\r\n\r\n", 0, http_head.MAX_HEAD)
    if end >= 0:  # a chunked body with a Content-Length too: by the chunks alone
        rewritten = http_head.chunked_only(data[: end + 4])
        if rewritten is not None:
            data = rewritten + data[end + 4 :]
    if data:
        handler.data_received(data)
