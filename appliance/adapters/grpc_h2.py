"""HTTP/2 for gRPC on the event loop: one :class:`Connection` per client connection.

The gRPC listener (:mod:`appliance.adapters.grpc_server`) serves on asyncio directly
instead of through grpcio's asyncio server, whose own per-call machinery (completion
queue, poller thread, Cython call objects) cost more than this server's whole HTTP
path. This module is the HTTP/2 part a gRPC server needs (RFC 9113), no more:

- frames: SETTINGS (acknowledged; the peer's window and frame size honoured), PING
  (answered), WINDOW_UPDATE, HEADERS with CONTINUATION, DATA (padding stripped),
  RST_STREAM (cancels the call), GOAWAY (both ways), PRIORITY ignored;
- flow control: the receive windows are opened wide and replenished as data is
  consumed; outbound DATA waits for the peer's connection and stream windows and is
  split at the peer's maximum frame size;
- header blocks: decoded per connection (:class:`grpc_frames.HeaderDecoder`); this
  server's own are fixed literals (:mod:`appliance.adapters.grpc_calls`).

What a call does with its messages is :mod:`appliance.adapters.grpc_calls`'s business:
the connection hands it each new stream (``Handler.open``), each complete gRPC message
(``call.message``), the end of the stream (``call.end``) and a reset (``call.cancel``);
the call answers through :meth:`Connection.send`. A peer that breaks the protocol gets
GOAWAY with the error code and is closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any, Protocol, cast

from appliance.adapters.grpc_frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_HEADER_BLOCK,
    MAX_STREAMS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECEIVE_WINDOW,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    FrameReader,
    HeaderDecoder,
    ProtocolError,
    Stream,
    data_head,
    frame,
    settings,
)

log = logging.getLogger(__name__)


class Handler(Protocol):
    """The gRPC side (:mod:`appliance.adapters.grpc_calls`)."""

    def open(self, connection: Connection, stream: Stream) -> None: ...


class Connection(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client."""

    def __init__(self, handler: Handler, max_message: int, on_close: Callable[[Connection], None]):
        self.handler = handler
        self.max_message = max_message
        self._on_close = on_close
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._header_decoder = HeaderDecoder()
        self.streams: dict[int, Stream] = {}
        self.calls: set[asyncio.Task[None]] = set()  # running calls (referenced here)
        self._last_stream = 0
        self._continuation: tuple[int, int, bytearray] | None = None  # id, flags, block
        self._send_window = 65535  # the connection's, as the peer grants it
        self._peer_window = 65535  # initial window of each new stream
        self._peer_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self._received = 0  # connection-level bytes consumed since the last update
        self.going_away = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's too
        settings = struct.pack(">HIHIHI", 3, MAX_STREAMS, 4, RECEIVE_WINDOW, 6, MAX_HEADER_BLOCK)
        update = struct.pack(">I", MAX_WINDOW - 65535)
        transport.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, update))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._on_close(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is full (big responses)."""
        if self._paused and self.transport is not None:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def data_received(self, data: bytes) -> None:
        try:
            for kind, flags, stream, payload in self._reader.frames(data):
                self._frame(kind, flags, stream, payload)
                if self.transport is None:
                    break
        except ProtocolError as exc:
            log.info("grpc: closing a connection that broke HTTP/2: %s", exc)
            self.close(exc.code)

    # ---- inbound frames --------------------------------------------------------------

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if self._continuation is None or self._continuation[0] != sid:
                raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            block = self._continuation[2]
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise ProtocolError(ENHANCE_YOUR_CALM, "a header block over 64 KiB")
            if flags & END_HEADERS:
                start_flags = self._continuation[1]
                self._continuation = None
                self._open(sid, start_flags, bytes(block))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if not flags & ACK and self.transport is not None:
                self.transport.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(sid, None)
            if stream is not None:
                stream.closed = True
                self._cancel(stream)
        elif kind == GOAWAY:
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    def _settings(self, payload: memoryview) -> None:
        for key, value in settings(payload):
            if key == 4:  # INITIAL_WINDOW_SIZE: applies to every open stream
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                delta, self._peer_window = value - self._peer_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == 5:
                if not 16384 <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, "a bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_frame = value
        assert self.transport is not None
        self.transport.write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE of a bad length")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if sid == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "the connection window overflowed")
            self._flush_all()
        elif (stream := self.streams.get(sid)) is not None:
            stream.send_window += increment
            self._flush(stream)

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if not flags & END_HEADERS:
            self._continuation = (sid, flags, bytearray(payload))
            return
        self._open(sid, flags, bytes(payload))

    def _open(self, sid: int, flags: int, block: bytes) -> None:
        headers = self._header_decoder.decode(block)
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client: only END_STREAM matters
            if flags & END_STREAM:
                self._ended(stream)
            return
        if sid % 2 == 0 or sid <= self._last_stream:
            if sid <= self._last_stream:
                return  # a stream we already closed: late frames are dropped
            raise ProtocolError(PROTOCOL_ERROR, f"a client stream with an even id {sid}")
        self._last_stream = sid
        if self.going_away:
            self._reset(sid, 7)  # REFUSED_STREAM: the client retries elsewhere
            return
        if len(self.streams) >= MAX_STREAMS:
            self._reset(sid, 7)
            return
        stream = Stream(sid, headers, self._peer_window)
        self.streams[sid] = stream
        self.handler.open(self, stream)
        if flags & END_STREAM:
            self._ended(stream)

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        size = len(payload)
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1 : size - pad]
        self._received += size
        if self._received > RECEIVE_WINDOW // 2 and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
            self._received = 0
        stream = self.streams.get(sid)
        if stream is None or stream.ended:
            return  # a stream that ended or was reset: its data counts for the window only
        call = stream.call
        buffer = stream.buffer
        if not buffer:  # messages that lie whole in this frame are taken straight from it
            taken = self._take(call, payload)
            if taken < 0:
                return
            payload = payload[taken:]
        if len(payload):
            buffer += payload
            with memoryview(buffer) as whole:
                taken = self._take(call, whole)
            if taken < 0:
                return
            del buffer[:taken]
        if call.unary:  # the window is given back as the data comes: the call holds it all
            self.consumed(stream, size)
        if flags & END_STREAM:
            self._ended(stream)

    def _take(self, call: Any, data: memoryview) -> int:
        """Hand every whole gRPC message at the start of ``data`` to ``call``; the bytes
        taken, or -1 when a message is over the limit (the call answered it)."""
        taken, end = 0, len(data)
        while end - taken >= 5:
            n = int.from_bytes(data[taken + 1 : taken + 5], "big")
            if n > self.max_message:
                call.too_large(n)
                return -1
            if end - taken < 5 + n:
                break
            call.message(bytes(data[taken + 5 : taken + 5 + n]), data[taken])
            taken += 5 + n
        return taken

    def consumed(self, stream: Stream, size: int) -> None:
        """``size`` bytes of ``stream`` were taken in: the client may send that much
        more once half its window is used (a streaming call gives its window back
        only as it reads its requests, so a slow model stops the client)."""
        stream.received += size
        if stream.received > RECEIVE_WINDOW // 2 and not stream.ended and self.transport:
            update = struct.pack(">I", stream.received)
            self.transport.write(frame(WINDOW_UPDATE, 0, stream.id, update))
            stream.received = 0

    def _ended(self, stream: Stream) -> None:
        stream.ended = True
        stream.call.end(bool(stream.buffer))
        if stream.closed:  # answered before the client finished sending
            self.streams.pop(stream.id, None)

    def _cancel(self, stream: Stream) -> None:
        stream.call.cancel()

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
        transport = self.transport
        out: list[bytes | memoryview] = chunks if chunks is not None else []
        while stream.pending and transport is not None:
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
                break
            stream.pending.popleft()
            if tail:
                out.append(tail)
            if end:
                stream.closed = True
                self._write(out)
                out = []
                self._finished(stream)
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
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush(stream)

    def _finished(self, stream: Stream) -> None:
        if stream.ended or self.streams.get(stream.id) is not stream:
            self.streams.pop(stream.id, None)
        elif self.transport is not None:  # we are done before the client: stop it sending
            self.transport.write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR)))
            self.streams.pop(stream.id, None)
        if self.going_away and not self.streams:
            self.close()

    def _reset(self, sid: int, code: int) -> None:
        if self.transport is not None:
            self.transport.write(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        """End ``stream`` at once (its call gave up, e.g. a message over the limit)."""
        stream.closed = True
        stream.pending.clear()
        self._reset(stream.id, code)
        self.streams.pop(stream.id, None)

    def goaway(self) -> None:
        """No new streams (shutting down); the connection closes once its streams end."""
        if self.transport is None:
            return
        self.going_away = True
        last = struct.pack(">II", self._last_stream, NO_ERROR)
        self.transport.write(frame(GOAWAY, 0, 0, last))
        if not self.streams:
            self.close()

    def close(self, code: int = NO_ERROR) -> None:
        transport, self.transport = self.transport, None
        if transport is None:
            return
        if code != NO_ERROR:
            transport.write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code)))
        transport.close()
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
