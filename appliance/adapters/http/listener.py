"""The HTTP/1.1 endpoints (:func:`listen`): :mod:`appliance.adapters.http.front` on a
listening socket, with what it answers itself (inference and the read-only routes it is
given) and, behind it, the aiohttp application made on first need
(:mod:`appliance.adapters.http.backstage`) for the connections it hands over; or
nothing behind it (the metrics endpoint: what it does not answer is refused).
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from appliance.adapters.access import AccessPolicy
from appliance.adapters.http.backstage import Backstage
from appliance.adapters.http.front import Front
from appliance.adapters.http.reads import Routes
from appliance.core.dataplane import DataPlane


class Listener:
    """One HTTP endpoint: its front on the listening socket, and what is behind it."""

    def __init__(self, server: asyncio.Server, front: Front) -> None:
        self.server = server
        self.front = front

    @property
    def backstage(self) -> Backstage | None:
        return self.front.backstage


async def listen(
    sock: socket.socket,
    ssl_context: ssl.SSLContext | None,
    dataplane: DataPlane,
    access: AccessPolicy,
    max_request_size: int,
    header_timeout_s: float,
    body_timeout_s: float,
    routes: Routes,
    backstage: Backstage | None,
    infer: bool = True,
) -> Listener:
    """Serve ``sock`` (bound) with a front answering ``routes`` (and inference, unless
    ``infer`` is False), handing the rest to ``backstage``."""
    front = Front(
        dataplane,
        access,
        backstage,
        max_request_size,
        header_timeout_s,
        body_timeout_s,
        routes,
        infer,
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(front.protocol, sock=sock, ssl=ssl_context, backlog=128)
    return Listener(server, front)
