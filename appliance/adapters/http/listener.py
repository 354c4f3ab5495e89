"""The HTTP/1.1 endpoint (:func:`listen`): :mod:`appliance.adapters.http.front` on the
listening socket, aiohttp's runner behind it (:class:`Listener`) for the connections
handed over and their routes.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from aiohttp import web

from appliance.adapters.access import AccessPolicy
from appliance.adapters.http.front import Front
from appliance.core.dataplane import DataPlane


class Listener:
    """The HTTP endpoint: this front on the listening socket, aiohttp's runner behind
    it (for the connections handed over, and their routes)."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server, front: Front) -> None:
        self.runner = runner
        self.server = server
        self.front = front


async def listen(
    runner: web.AppRunner,
    sock: socket.socket,
    ssl_context: ssl.SSLContext | None,
    dataplane: DataPlane,
    access: AccessPolicy,
    max_request_size: int,
    header_timeout_s: float,
    body_timeout_s: float,
) -> Listener:
    """Serve ``sock`` (bound) with this front; ``runner`` is set up."""
    assert runner.server is not None, "runner.setup() first"
    front = Front(
        dataplane, access, runner.server, max_request_size, header_timeout_s, body_timeout_s
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(front.protocol, sock=sock, ssl=ssl_context, backlog=128)
    return Listener(runner, server, front)
