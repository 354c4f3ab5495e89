"""HTTP/2 for gRPC on the event loop: one :class:`Connection` per client connection, a
thin asyncio driver over the sans-I/O :class:`~appliance.adapters.grpc.h2.machine.Machine`.

The gRPC listener (:mod:`appliance.adapters.grpc.server`) serves on asyncio directly
instead of through grpcio's asyncio server, whose own per-call machinery (completion
queue, poller thread, Cython call objects) cost more than this server's whole HTTP
path. The driver owns only what needs I/O or the loop: the transport, the loop's time,
the watchdog's timer, and write backpressure. Each read goes to the machine with the
time; what the machine queued in that turn (answers, window updates, acknowledgements)
goes out in one write, as does each call's answer (a unary answer: one system call).

What the server holds for a client that does not read is bounded: the transport's
write buffer has a high-water mark (:attr:`H2Limits.write_buffer`), past which the
connection stops *reading*; a streaming call waits in :meth:`Connection.drain` while its
answers cannot leave; a client that took nothing from a full buffer for
``read_timeout_s`` is dropped; and a closed connection whose last bytes the client
will not take is dropped after ``read_timeout_s`` instead of lingering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

from appliance.adapters.grpc.h2.frames import CANCEL, INTERNAL_ERROR, NO_ERROR, Stream
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.adapters.grpc.h2.machine import ADMITTED, OVER, REFUSED, Handler, Machine

log = logging.getLogger("appliance.adapters.grpc.h2.connection")

__all__ = ["ADMITTED", "OVER", "REFUSED", "Connection", "Handler"]


class Connection(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client: what its calls send and wait through."""

    def __init__(
        self,
        handler: Handler,
        max_message: int,
        on_close: Callable[[Connection], None],
        limits: H2Limits | None = None,
    ):
        self.limits = limits or H2Limits()
        self.max_message = max_message
        self.machine = Machine(handler, self.limits, self)
        self.transport: asyncio.Transport | None = None
        self.calls: set[asyncio.Task[None]] = set()  # running calls (referenced here)
        self._on_close = on_close
        self._busy = False  # inside a read: what the calls send goes out with its turn
        self._paused = False  # the write buffer is past its high-water mark
        self._paused_at = 0.0  # loop time of the last progress while paused
        self._unsent = 0  # the write buffer's size at the watchdog's last look
        self._waiters: list[asyncio.Future[None]] = []  # drain() callers
        self._watch: asyncio.TimerHandle | None = None
        self._abort: asyncio.TimerHandle | None = None
        self.created = time.monotonic()  # a TLS handshake may come before connection_made
        self.made = False  # connection_made was called (a TLS handshake succeeded)
        self._gate: asyncio.Future[None] | None = None  # not read until it is done
        self._early = bytearray()  # received while the gate was closed (at most a read)

    def hold(self, gate: asyncio.Future[None]) -> None:
        """Read nothing of the client's until ``gate`` is done (the calls' handler is
        being loaded); closed if it fails. Our preface goes out meanwhile."""
        self._gate = gate
        if self.transport is not None:
            self._wait_for_gate()

    def _wait_for_gate(self) -> None:
        gate, transport = self._gate, self.transport
        if gate is None or transport is None:
            return
        if gate.done() and not gate.cancelled() and gate.exception() is None:
            self._gate = None  # open already
            return
        transport.pause_reading()
        gate.add_done_callback(self._gate_done)

    def _gate_done(self, gate: asyncio.Future[None]) -> None:
        if self.transport is None:
            return
        if gate.cancelled() or gate.exception() is not None:
            self.close(INTERNAL_ERROR, "the server cannot serve gRPC calls now")
            return
        self._gate = None
        if self._early:
            early, self._early = bytes(self._early), bytearray()
            self.data_received(early)
        if not self._paused and self.transport is not None:
            self.transport.resume_reading()

    @property
    def streams(self) -> dict[int, Stream]:
        return self.machine.streams

    # ---- what the calls use ----------------------------------------------------------

    def send(
        self, stream: Stream, head: bytes, data: bytes | memoryview, tail: bytes, end: bool
    ) -> None:
        """Send ``head`` (a HEADERS frame or nothing), ``data`` as DATA frames within
        the windows and ``tail`` after it (:meth:`Outbound.send`); ``end``: the stream
        is done after it."""
        self.machine.out.send(stream, head, data, tail, end)
        if not self._busy:
            self._pump()

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        self.machine.reset(stream, code)
        if not self._busy:
            self._pump()

    def consumed(self, stream: Stream, size: int) -> None:
        self.machine.inbound.consumed(stream, size)
        if not self._busy:
            self._pump()

    async def drain(self, stream: Stream) -> None:
        """Wait while ``stream``'s answers cannot leave: the write buffer is full or the
        client's window holds its data back (a streaming call then stops producing)."""
        while self.transport is not None and not stream.closed and (self._paused or stream.pending):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def goaway(self) -> None:
        """No new streams (shutting down); the connection closes once its streams end."""
        self.machine.goaway()
        self._pump()

    def close(self, code: int = NO_ERROR, debug: str = "") -> None:
        """Close the connection; every call still running is cancelled."""
        self.machine.close(code, debug)
        self._pump()

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's too
        limit = self.limits.write_buffer
        self.transport.set_write_buffer_limits(high=limit, low=limit // 4)
        self.made = True
        loop = asyncio.get_running_loop()
        self.machine.start(loop.time())
        self._pump()
        self._watch = loop.call_later(self.limits.tick_s, self._tick)
        if self._gate is not None:
            self._wait_for_gate()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # closing after an error: what the client sends now is dropped
        if self._gate is not None:  # (a read the loop had begun before the pause)
            self._early += data
            self.transport.pause_reading()
            return
        self._busy = True
        try:
            self.machine.receive(data, asyncio.get_running_loop().time())
        finally:
            self._busy = False
        self._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for handle in (self._watch, self._abort):
            if handle is not None:
                handle.cancel()
        self.machine.lost()
        self._wake()
        self._on_close(self)

    def pause_writing(self) -> None:
        self._paused = True
        self._unsent = 1 << 62
        self._paused_at = asyncio.get_running_loop().time()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        self.machine.watch.resumed(asyncio.get_running_loop().time())
        if self.transport is not None and self._gate is None:
            self.transport.resume_reading()
        self._wake()

    # ---- the driver ------------------------------------------------------------------

    def _pump(self) -> None:
        """Write what the machine queued, in one call; wake the calls waiting to send;
        end the transport when the machine ended the connection."""
        machine, transport = self.machine, self.transport
        chunks = machine.out.take()
        if transport is not None and chunks:
            if len(chunks) == 1:
                transport.write(chunks[0])
            elif sum(len(c) for c in chunks) <= 65536:
                transport.write(b"".join(chunks))  # small: one copy, one system call
            else:
                transport.writelines(chunks)
        if self._waiters:
            self._wake()
        if machine.closing is not None and transport is not None:
            self._end(transport, *machine.closing)

    def _end(self, transport: asyncio.Transport, code: int, debug: str) -> None:
        """A graceful end just closes. After an error or a timeout (its GOAWAY written)
        the driver half-closes and keeps reading (and dropping) what the client sends
        for a moment before closing: closing a socket with unread bytes resets it, and
        the client would lose the GOAWAY."""
        self.transport = None
        if code != NO_ERROR or debug:
            if transport.can_write_eof():
                transport.write_eof()
            transport.resume_reading()
            linger = min(1.0, self.limits.read_timeout_s)
            self._abort = asyncio.get_running_loop().call_later(linger, self._closed, transport)
        else:
            self._closed(transport)
        self._wake()

    def _closed(self, transport: asyncio.Transport) -> None:
        transport.close()  # flushes the buffer; a client that does not read is dropped:
        loop = asyncio.get_running_loop()
        self._abort = loop.call_later(self.limits.read_timeout_s, transport.abort)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _tick(self) -> None:
        self._watch = None
        if self.transport is None:
            return
        now = asyncio.get_running_loop().time()
        why, code = self.machine.overdue(now, self._paused)
        if why:
            log.info("grpc: closing a connection: %s", why)
            self.close(code, why)
            return
        if self._write_stalled(now):
            log.info("grpc: dropping a connection whose client stopped reading")
            self.transport.abort()
            return
        if self.machine.idle(now, bool(self.calls)):
            self.goaway()  # no streams: closes now
            return
        self._watch = asyncio.get_running_loop().call_later(self.limits.tick_s, self._tick)

    def _write_stalled(self, now: float) -> bool:
        """True when the client took nothing from a full write buffer for
        ``read_timeout_s``."""
        if not self._paused or self.transport is None:
            return False
        size = self.transport.get_write_buffer_size()
        if size < self._unsent:
            self._paused_at = now
        self._unsent = size
        return now - self._paused_at >= self.limits.read_timeout_s
