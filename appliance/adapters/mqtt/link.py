"""paho's connection on the asyncio event loop: :class:`LoopDriver` drives the client
through paho's external-loop interface by the socket's readiness and reads the
incoming packets itself (PUBLISH decoded by :mod:`appliance.adapters.mqtt.packets`,
the rest handed to paho) and writes the bridge's own packets, all through the
:class:`~appliance.adapters.mqtt.socket.BufferedSocket` paho's connection uses.

With paho's own network thread every packet crossed between that thread and the event
loop (a wake-up each way, a ``select`` per turn, the GIL handed back and forth): on a
small request that thread cost more CPU than the request's whole HTTP path. Here the
client lives on the loop's thread and nothing crosses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from appliance.adapters.mqtt.packets import (
    PUBACK,
    PUBLISH,
    Framer,
    PacketError,
    decode_puback,
    decode_publish,
)
from appliance.adapters.mqtt.protocol import Inbound, backoff_delay
from appliance.adapters.mqtt.socket import BufferedSocket

log = logging.getLogger("appliance.adapters.mqtt.bridge")

_REFUSAL_GRACE_S = 2.0  # a DISCONNECT for a refused packet gets this long to go out
_NOT_YET = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class LoopDriver:
    """paho's external-loop interface driven by the event loop's readiness callbacks: no
    network thread, no ``select``, no hand-off between threads per packet.

    - when the socket is readable the driver reads it and cuts the bytes into
      packets: a PUBLISH is decoded here and given to ``on_publish`` (the bridge's
      admission runs right there, on the loop), a PUBACK (of the bridge's own
      publishes: paho publishes nothing) to ``on_puback``; any other packet is handed
      to paho whole and ``loop_read`` runs for it (paho's callbacks run there). A packet the
      decoder refuses (:class:`PacketError`) goes to ``on_refused`` and closes the
      connection with the DISCONNECT reason code MQTT v5 prescribes; the bridge
      reconnects;
    - what :meth:`write` (the bridge's PUBLISH and PUBACK packets) and paho queue is
      written at the end of the loop iteration that queued it (one write for a reply
      and its PUBACK), and again whenever the socket is writable while a full send
      buffer holds the rest;
    - ``loop_misc`` (keep-alive pings, a dead peer noticed) runs once a second.

    Only :meth:`connect` leaves the loop: paho's connect blocks (DNS, TCP connect, TLS
    handshake), so it runs on a worker thread while nothing else touches the client,
    and the socket is attached to the loop once it returns. Every call here is made on
    the event loop's thread. :meth:`start` runs the connection task (connect, serve
    the connection until it ends, back off with jitter, again) until :meth:`stop`.
    """

    _TICK_S = 1.0

    def __init__(
        self,
        client: mqtt.Client,
        loop: asyncio.AbstractEventLoop,
        packet_limit: int,
        on_publish: Callable[[Inbound], None],
        on_puback: Callable[[int, int], None],
        on_refused: Callable[[PacketError], None],
    ) -> None:
        self._client = client
        self._loop = loop
        self._packet_limit = packet_limit
        self._on_publish = on_publish
        self._on_puback = on_puback
        self._on_refused = on_refused
        self._framer = Framer(packet_limit)
        self._refusing = False  # a packet was refused: the rest of this connection is dropped
        self._sock: Any = None  # attached to the loop: set only on the loop's thread
        self._flush_pending = False
        self._writer = False
        self._tick: asyncio.TimerHandle | None = None
        self._closed: asyncio.Future[None] | None = None
        self._halt = asyncio.Event()  # stop(): no more connection attempts
        self._accepted = False  # the broker accepted a connection since the last backoff
        self._runner: asyncio.Task[None] | None = None
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = _ignore  # _flush keeps the writer in step
        client.on_socket_close = self._socket_closed

    def start(
        self,
        host: str,
        port: int,
        options: Callable[[], dict[str, Any]],
        reconnect_min_s: float,
        reconnect_max_s: float,
    ) -> None:
        """Run the connection task: ``options()`` gives each attempt's connect options."""
        self._runner = self._loop.create_task(
            self._run(host, port, options, reconnect_min_s, reconnect_max_s)
        )

    def accepted(self) -> None:
        """The broker accepted the connection: the next reconnect backs off from the start."""
        self._accepted = True

    async def stop(self, timeout_s: float) -> None:
        """No more attempts -> DISCONNECT -> the task ends once the socket closes; a
        goodbye that does not get out in ``timeout_s`` (a broker that does not read, or
        a slow connect) is cut short, and a task still not done after 10 s is left."""
        self._halt.set()  # before the DISCONNECT: the task must not reconnect
        if self._runner is None:
            return
        self.disconnect()
        done, _ = await asyncio.wait({self._runner}, timeout=timeout_s)
        if not done:
            self.abort()
            done, _ = await asyncio.wait({self._runner}, timeout=10.0)
        if not done:
            log.warning("mqtt: the connection did not end; leaving it behind")
            self._runner.cancel()

    async def _run(
        self,
        host: str,
        port: int,
        options: Callable[[], dict[str, Any]],
        low: float,
        high: float,
    ) -> None:
        attempt = 0
        while not self._halt.is_set():
            try:
                await self.connect(host, port, **options())
            except Exception as exc:  # OSError, ssl.SSLError, ValueError: all retried
                log.warning("mqtt: cannot connect to %s:%d: %s", host, port, exc)
            else:
                if self._halt.is_set():  # stop() came while connecting: say goodbye
                    self.disconnect()
                await self.closed()
                if self._accepted:
                    self._accepted, attempt = False, 0
            if self._halt.is_set():
                break
            delay = backoff_delay(attempt, low, high, random.random)
            attempt += 1
            log.info("mqtt: reconnecting in %.2fs (attempt %d)", delay, attempt)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._halt.wait(), delay)

    async def connect(self, host: str, port: int, **options: Any) -> None:
        """Open the connection (CONNECT queued) on a worker thread, then attach it."""
        await asyncio.to_thread(self._client.connect, host, port, **options)
        sock = self._client.socket()
        if sock is None:
            raise ConnectionError("the connection closed while it was opened")
        if not isinstance(sock, BufferedSocket):  # a paho that no longer calls _create_socket
            self._client.disconnect()
            raise RuntimeError("paho built its socket without _create_socket (paho is pinned)")
        self._sock = sock
        self._framer, self._refusing = Framer(self._packet_limit), False
        self._closed = self._loop.create_future()
        self._loop.add_reader(sock, self._guard, self._read)
        self._tick = self._loop.call_later(self._TICK_S, self._guard, self._misc)
        self._flush_soon()  # the CONNECT

    async def closed(self) -> None:
        """Until the attached connection has closed (at once when none is attached)."""
        if self._closed is not None:
            await asyncio.shield(self._closed)

    def disconnect(self) -> None:
        """Send DISCONNECT; the socket closes once it is written."""
        if self._sock is not None:
            self._client.disconnect()

    def abort(self) -> None:
        """Close a connection whose goodbye does not get out (a peer that stopped
        reading): paho sees the end of the stream and closes its socket."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _guard(self, step: Callable[[], None]) -> None:
        """Whatever goes wrong ends this connection, never the bridge."""
        try:
            step()
        except Exception:
            log.exception("mqtt: the network loop failed; closing the connection")
            self.abort()

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            data = sock.read()
        except _NOT_YET:
            return
        except OSError as exc:  # reset: paho reads the error and closes the connection
            sock.end(exc)
            self._client.loop_read()
            return
        if not data:  # the broker closed: paho reads the end and closes the connection
            sock.end(None)
            self._client.loop_read()
            return
        if not self._refusing:
            self._take(sock, data)
        # bytes TLS has decrypted already are unseen by the selector: read on at the
        # next turn, after the callbacks waiting now
        if self._sock is sock and sock.pending() > 0:
            self._loop.call_soon(self._guard, self._read)

    def _take(self, sock: BufferedSocket, data: bytes) -> None:
        """Each whole packet in order: PUBLISH to the bridge, the others to paho."""
        framer = self._framer
        framer.feed(data)
        try:
            while self._sock is sock and (packet := framer.next()) is not None:
                header, body = packet
                kind = header >> 4
                if kind == PUBLISH:
                    self._on_publish(decode_publish(header, body))
                elif kind == PUBACK:
                    self._on_puback(*decode_puback(header, body))
                else:
                    sock.hand(header, body)
                    self._client.loop_read()
        except PacketError as exc:
            self._refuse(sock, exc)

    def _refuse(self, sock: BufferedSocket, exc: PacketError) -> None:
        """MQTT v5 section 4.13: DISCONNECT with the reason code, then close; what
        else comes on this connection is dropped unread."""
        log.warning(
            "mqtt: refused a packet from the broker (reason 0x%02x): %s; reconnecting",
            exc.reason,
            exc,
        )
        self._refusing = True
        self._framer = Framer(self._packet_limit)
        self._on_refused(exc)
        self._client.disconnect(ReasonCode(PacketTypes.DISCONNECT, identifier=exc.reason))
        self._loop.call_later(_REFUSAL_GRACE_S, self._guard, lambda: self._cut(sock))

    def _cut(self, sock: BufferedSocket) -> None:
        if self._sock is sock:  # the DISCONNECT did not get out: close without it
            self.abort()

    def write(self, packet: bytes) -> None:
        """One whole packet of the bridge's own, after what paho has queued so far
        (its SUBSCRIBE goes out before the "online" status); dropped while no
        connection is attached (the bridge resends what must be)."""
        sock = self._sock
        if sock is None:
            return
        if self._client.want_write():  # paho's packets first, in the order they came
            sock.gather()
            self._client.loop_write()
            if self._sock is not sock:
                return
        sock.queue(packet)
        self._flush_soon()

    def _want_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # also called on the connect's worker thread, before the socket is attached
        if self._sock is not None:
            self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._guard, self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        sock = self._sock
        if sock is None:
            return
        sock.gather()  # (connect() attached a BufferedSocket, no other)
        try:
            if self._client.want_write():  # paho's own packets (else loop_write only raises
                self._client.loop_write()  # and catches IndexError); may close the socket
        finally:
            backlog = sock.flush()
        wanted = self._sock is not None and (backlog or self._client.want_write())
        if wanted and not self._writer:  # the send buffer is full: go on when writable
            self._loop.add_writer(self._sock, self._guard, self._flush)
        elif self._writer and not wanted:
            self._remove_writer()
        self._writer = wanted

    def _misc(self) -> None:
        self._tick = None
        if self._sock is not None:
            self._client.loop_misc()
        if self._sock is not None:
            self._tick = self._loop.call_later(self._TICK_S, self._guard, self._misc)

    def _socket_closed(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        if sock is not self._sock:  # not attached (the connect's own clean-up)
            return
        self._loop.remove_reader(sock)
        self._remove_writer()
        self._writer = False
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._sock = None
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def _remove_writer(self) -> None:
        if self._writer and self._sock is not None:
            self._loop.remove_writer(self._sock)


def _ignore(*args: Any) -> None:
    pass
