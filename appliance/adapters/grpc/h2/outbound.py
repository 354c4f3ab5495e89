"""The writing half of a gRPC client connection (:class:`Outbound`, the base of
:class:`appliance.adapters.grpc.h2.connection.Connection`): DATA within the client's windows and
split at its frame size, stream and connection endings, GOAWAY, and write backpressure.

What the server holds for a client that does not read is bounded: outbound DATA waits
in its stream for window (at most what a call produced); the transport's write buffer
has a high-water mark (:attr:`H2Limits.write_buffer`), past which the connection stops
*reading*, so a client that sends requests or PINGs without reading their answers
makes the server do no more work; a streaming call waits in :meth:`drain` while its
answers cannot leave; and a closed connection whose last bytes the client will not
take is dropped after ``read_timeout_s`` instead of lingering.
"""

from __future__ import annotations

import asyncio
from typing import cast

from appliance.adapters.grpc.h2.frames import (
    CANCEL,
    DATA,
    NO_ERROR,
    Stream,
    data_head,
    goaway,
    rst_stream,
)
from appliance.adapters.grpc.h2.limits import Budget, H2Limits


class Outbound(asyncio.Protocol):
    """A connection's writes; the reading half (:mod:`grpc_h2`) subclasses it."""

    def __init__(self, limits: H2Limits) -> None:
        self.limits = limits
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.calls: set[asyncio.Task[None]] = set()  # running calls (referenced here)
        self._lingering: set[asyncio.Task[None]] = set()  # calls of dropped streams, unwinding
        self._blocked: dict[int, Stream] = {}  # streams whose data waits for window
        self._budget = Budget(limits.flood_burst, limits.flood_rate)
        self._last_stream = 0
        self._send_window = 65535  # the connection's, as the peer grants it
        self._peer_window = 65535  # initial window of each new stream
        self._peer_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.going_away = False
        self._paused = False  # the write buffer is past its high-water mark
        self._paused_at = 0.0  # loop time of the last progress while paused
        self._unsent = 0  # the write buffer's size at the watchdog's last look
        self._waiters: list[asyncio.Future[None]] = []  # drain() callers
        self._abort: asyncio.TimerHandle | None = None

    # ---- backpressure ----------------------------------------------------------------

    def pause_writing(self) -> None:
        self._paused = True
        self._unsent = 1 << 62
        self._paused_at = asyncio.get_running_loop().time()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self, stream: Stream) -> None:
        """Wait while ``stream``'s answers cannot leave: the write buffer is full or the
        client's window holds its data back (a streaming call then stops producing)."""
        while self.transport is not None and not stream.closed and (self._paused or stream.pending):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _write_stalled(self, now: float) -> bool:
        """The watchdog's look at a paused write buffer: True when the client took
        nothing from it for ``read_timeout_s``."""
        if not self._paused or self.transport is None:
            return False
        size = self.transport.get_write_buffer_size()
        if size < self._unsent:
            self._paused_at = now
        self._unsent = size
        return now - self._paused_at >= self.limits.read_timeout_s

    # ---- outbound --------------------------------------------------------------------

    def send(
        self, stream: Stream, head: bytes, data: bytes | memoryview, tail: bytes, end: bool
    ) -> None:
        """Write ``head`` (a HEADERS frame or nothing), ``data`` as DATA frames within
        the windows and ``tail`` (frames, e.g. trailers) after all of the data; what
        does not fit waits for WINDOW_UPDATE. ``end``: the stream is done after it.
        What fits goes out in one write (a unary answer: one system call)."""
        if self.transport is None or stream.closed:
            return
        view = memoryview(data).cast("B") if len(data) else memoryview(b"")
        stream.pending.append((view, end, tail))
        self._flush(stream, [head] if head else [])

    def _flush(self, stream: Stream, chunks: list[bytes | memoryview] | None = None) -> None:
        out: list[bytes | memoryview] = chunks if chunks is not None else []
        while stream.pending and self.transport is not None:
            view, end, tail = stream.pending[0]
            while len(view):
                room = min(self._send_window, stream.send_window, self._peer_frame)
                if room <= 0:
                    break
                piece = view[:room]
                out.append(data_head(DATA, 0, stream.id, len(piece)))
                out.append(piece)
                view = view[len(piece) :]
                self._send_window -= len(piece)
                stream.send_window -= len(piece)
            if len(view):
                stream.pending[0] = (view, end, tail)
                self._blocked[stream.id] = stream
                break
            stream.pending.popleft()
            if tail:
                out.append(tail)
            if end:
                stream.closed = True
                self._write(out)
                out = []
                self._finished(stream)
        if not stream.pending:
            if self._blocked:
                self._blocked.pop(stream.id, None)
            if self._waiters:
                self._wake()
        self._write(out)

    def _write(self, chunks: list[bytes | memoryview]) -> None:
        if not chunks or self.transport is None:
            return
        if len(chunks) == 1:
            self.transport.write(chunks[0])
        elif sum(len(c) for c in chunks) <= 65536:
            self.transport.write(b"".join(chunks))  # small: one copy, one system call
        else:
            self.transport.writelines(chunks)

    def _flush_all(self) -> None:
        for stream in list(self._blocked.values()):
            self._flush(stream)

    def _finished(self, stream: Stream) -> None:
        """We sent END_STREAM: the stream is over (told to stop sending if the client
        has not finished), and the call it served earns the connection's budget back."""
        self._budget.earn(self.limits.flood_refund)
        stream.buffer = bytearray()  # what the client still sends is dropped
        if not stream.ended and self.streams.get(stream.id) is stream:
            self._reset(stream.id, NO_ERROR)  # we are done before the client: stop it sending
        self.streams.pop(stream.id, None)
        if self._blocked:
            self._blocked.pop(stream.id, None)
        if self.going_away and not self.streams:
            self.close()

    def _reset(self, sid: int, code: int) -> None:
        if self.transport is not None:
            self.transport.write(rst_stream(sid, code))

    def _drop(self, stream: Stream) -> None:
        """Forget ``stream`` now; its call is cancelled and, until it has unwound, still
        counts against the concurrent streams (so resets do not make room: Rapid Reset)."""
        stream.closed = True
        stream.pending.clear()
        stream.buffer = bytearray()  # a message half received is dropped with its memory
        self.streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        if stream.call is not None:
            task = stream.call.cancel()
            if task is not None:
                self._lingering.add(task)
                task.add_done_callback(self._lingering.discard)
        self._wake()

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        """End ``stream`` at once with RST_STREAM (its call gave up, or the client broke
        the stream's rules)."""
        if self.streams.get(stream.id) is not stream:
            return  # already over (answered, or reset before)
        self._reset(stream.id, code)
        self._drop(stream)

    def goaway(self) -> None:
        """No new streams (shutting down, or idle); the connection closes once its
        streams end."""
        if self.transport is None:
            return
        self.going_away = True
        self.transport.write(goaway(self._last_stream, NO_ERROR))
        if not self.streams:
            self.close()

    def close(self, code: int = NO_ERROR, debug: str = "") -> None:
        """Close the connection; every call still running is cancelled.

        A graceful end (announced by :meth:`goaway`) just closes. An error or a timeout
        sends GOAWAY with ``code`` first, then half-closes and keeps reading (and
        dropping) what the client sends for a moment before closing: closing a socket
        with unread bytes resets it, and the client would lose the GOAWAY."""
        transport, self.transport = self.transport, None
        if transport is None:
            return
        loop = asyncio.get_running_loop()
        if code != NO_ERROR or debug:
            transport.write(goaway(self._last_stream, code, debug.encode("utf-8", "replace")))
            if transport.can_write_eof():
                transport.write_eof()
            transport.resume_reading()
            linger = min(1.0, self.limits.read_timeout_s)
            self._abort = loop.call_later(linger, self._closed, transport)
        else:
            self._closed(transport)
        for stream in list(self.streams.values()):
            self._drop(stream)
        self._blocked.clear()
        self._wake()

    def _closed(self, transport: asyncio.Transport) -> None:
        transport.close()  # flushes the buffer; a client that does not read is dropped:
        loop = asyncio.get_running_loop()
        self._abort = loop.call_later(self.limits.read_timeout_s, transport.abort)

    def _transport_of(self, transport: asyncio.BaseTransport) -> asyncio.Transport:
        transport = cast(asyncio.Transport, transport)  # uvloop's too
        limit = self.limits.write_buffer
        transport.set_write_buffer_limits(high=limit, low=limit // 4)
        return transport
