"""Closing the HTTP endpoint without dropping a request the server already received.

aiohttp's ``AppRunner.cleanup`` stops listening, then calls ``close()`` on every
connection and waits for them. Two things go wrong under load (aiohttp 3.x):

- a connection that is "closing" ignores every byte it receives from then on
  (``RequestHandler.data_received`` returns early), so a request whose body is
  still arriving never gets the rest of it: its handler waits until the client
  gives up or the drain timeout passes, and the client gets no answer;
- a request whose bytes are in the socket's receive buffer, not yet read by the
  event loop, rides on a connection that looks idle; closing it drops a request
  the client sent before the shutdown began.

:func:`close_http` therefore drains on its own first: stop listening -> until no
connection is left (bounded by the drain timeout): close each connection that is
idle (waiting for a next request, nothing unread in its socket); leave the others
be: their requests finish, and their answers say ``Connection: close`` (see
``http_api``), so the client does not send another one and aiohttp closes them
after the answer -> ``runner.cleanup()`` for whatever is left. Shutdown takes as
long as the requests in flight, not the drain timeout. The connections
:mod:`appliance.adapters.http.front` serves itself are drained the same way, by the
same test (idle, nothing unread), beside those it handed to aiohttp.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import termios
from typing import TYPE_CHECKING

from appliance.adapters.http.listener import Listener

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the drain looks at the connections (shutdown only)


def _unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes the kernel holds for this connection that the loop has not read yet."""
    if transport is None or transport.is_closing():  # (an SSL one has no socket then)
        return 0
    sock = transport.get_extra_info("socket")
    if sock is None or sock.fileno() < 0:
        return 0
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0
    return int(count[0])


def _idle(conn: web.RequestHandler) -> bool:
    """Waiting for its next request with none parsed: aiohttp's own test in its
    keep-alive timeout (``_process_keepalive``). aiohttp has no public one; where its
    internals differ, every connection counts as idle (aiohttp's own behaviour)."""
    if not hasattr(conn, "_waiter") or not hasattr(conn, "_messages"):
        return True
    waiter = conn._waiter
    return waiter is not None and not waiter.done() and not conn._messages


def _open(server: web.Server) -> list[web.RequestHandler]:
    """The connections not closed yet (aiohttp may list a closed one a while longer)."""
    return [c for c in server.connections if c.transport is not None]


async def close_http(listener: Listener, timeout_s: float) -> None:
    """Stop listening, answer what was received, close idle connections, clean up:
    the front's own connections (:mod:`appliance.adapters.http.front`) and those it
    handed to aiohttp alike."""
    listener.server.close()
    front, backstage = listener.front, listener.backstage
    server = backstage.server if backstage is not None else None  # (none: nothing handed over)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s

    def still_open() -> int:
        return len(front.connections) + (len(_open(server)) if server is not None else 0)

    while still_open() and loop.time() < end:
        for conn in list(front.connections):
            if conn.idle and not _unread_bytes(conn.transport):
                conn.close()
        for handler in _open(server) if server is not None else []:
            if _idle(handler) and not _unread_bytes(handler.transport):
                handler.force_close()
        await asyncio.sleep(POLL_S)
    if still_open():
        log.warning(
            "%d HTTP connection(s) still busy after %.0fs; closing them", still_open(), timeout_s
        )
        for conn in list(front.connections):
            conn.close()
    if backstage is not None:
        await backstage.cleanup()
