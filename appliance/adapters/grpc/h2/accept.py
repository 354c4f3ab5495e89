"""Who may connect to the gRPC endpoint: at most ``grpc_max_connections`` connections at
once, TLS handshakes included (:class:`Admission`); one more is turned away at once
(:class:`Refused`: the server's SETTINGS, GOAWAY ENHANCE_YOUR_CALM, closed).

A connection whose TLS handshake fails never reaches ``connection_made`` nor
``connection_lost``: the event loop just drops it. The admission holds connections
weakly, so uvloop's dropped ones leave at once; asyncio's linger in a reference cycle
until the garbage collector runs, and any connection still not made once the handshake
timeout (``grpc_read_timeout_s``) has passed is forgotten, so a burst of bad handshakes
holds slots for that long at most.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import cast

from appliance.adapters.grpc.h2.connection import Connection
from appliance.adapters.grpc.h2.frames import ENHANCE_YOUR_CALM, SETTINGS, frame, goaway
from appliance.adapters.grpc.h2.limits import H2Limits

log = logging.getLogger("appliance.adapters.grpc.server")


class Refused(asyncio.Protocol):
    """A connection turned away before it starts (too many are open)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)
        writer.write(frame(SETTINGS, 0, 0) + goaway(0, ENHANCE_YOUR_CALM, b"too many connections"))
        writer.close()

    def data_received(self, data: bytes) -> None:
        pass  # whatever the client sent is not read


class Admission:
    """The endpoint's open connections, and the protocol for each new one."""

    def __init__(
        self, limits: H2Limits, make: Callable[[Callable[[Connection], None]], Connection]
    ) -> None:
        self._limits = limits
        self._make = make
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._refused_at = 0.0  # when a refusal was last logged

    def protocol(self) -> asyncio.Protocol:
        """For the listener: a new Connection, or Refused when ``max_connections`` are
        open."""
        if self._full():
            return Refused()
        conn = self._make(self._connections.discard)
        self._connections.add(conn)
        return conn

    def open(self) -> list[Connection]:
        """The connections open or in their TLS handshake."""
        stale = time.monotonic() - self._limits.read_timeout_s - 0.5
        for conn in [c for c in self._connections if not c.made and c.created < stale]:
            self._connections.discard(conn)  # its handshake failed or timed out
        return list(self._connections)

    def _full(self) -> bool:
        limits = self._limits
        if len(self._connections) < limits.max_connections:
            return False
        connections = self.open()
        if len(connections) < limits.max_connections:
            return False
        if time.monotonic() - self._refused_at > 60.0:
            self._refused_at = time.monotonic()
            log.warning(
                "grpc: %d connections are open (grpc_max_connections): turning new ones away",
                len(connections),
            )
        return True
