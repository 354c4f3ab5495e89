"""HTTP/2 for gRPC on the event loop: one :class:`Connection` per client connection.

The gRPC listener (:mod:`appliance.adapters.grpc.server`) serves on asyncio directly
instead of through grpcio's asyncio server, whose own per-call machinery (completion
queue, poller thread, Cython call objects) cost more than this server's whole HTTP
path. The connection is three layers, each a class: :mod:`grpc_outbound` (writes,
windows, backpressure), :mod:`grpc_control` (the connection's life, its control frames,
the watchdog) and this module's :class:`Connection` (streams: HEADERS, CONTINUATION,
DATA, gRPC messages). Together they read what a client sends (RFC 9113), no more than
a gRPC server needs, and trust none of it:

- frames: the preface, then SETTINGS first; SETTINGS (the peer's window and frame size
  honoured, acknowledged), PING (answered), WINDOW_UPDATE, HEADERS with CONTINUATION,
  DATA, RST_STREAM (cancels the call), GOAWAY (both ways), PRIORITY (checked, else
  ignored); each frame's length, stream id and state rules are checked, and a frame on
  an idle stream, a stream id that does not increase or an even one is PROTOCOL_ERROR;
- flow control: what the client sends is counted against the windows the server
  granted (FLOW_CONTROL_ERROR past them); a unary call's window is given back as its
  message arrives, a streaming call's as it reads its requests;
- limits (:class:`grpc_limits.H2Limits`): concurrent streams, header block size and
  frames, a budget of frames that serve no call, and a watchdog for the preface, the
  SETTINGS acknowledgement, a half-sent frame or header block, a client that stopped
  reading, and an idle connection.

What a call does with its messages is :mod:`appliance.adapters.grpc.calls`'s business:
the connection hands it each new stream (``Handler.open``), each complete gRPC message
(``call.message``), the end of the stream (``call.end``) and a reset (``call.cancel``);
the call answers through :meth:`Outbound.send`. A stream error ends that stream with
RST_STREAM; a connection error ends the connection with GOAWAY and its error code.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Protocol

from appliance.adapters.grpc.h2.control import Control
from appliance.adapters.grpc.h2.frames import (
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    MAX_WINDOW,
    PADDED,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    ProtocolError,
    Stream,
    frame,
    unpad,
)
from appliance.adapters.grpc.h2.headers import HeaderDecoder
from appliance.adapters.grpc.h2.limits import H2Limits

# what a call says of a message whose length prefix came (Handler's call.admit)
ADMITTED, OVER, REFUSED = 1, 0, -1  # kept; the call answered; refused in its stream

__all__ = ["Connection", "Handler"]


class Handler(Protocol):
    """The gRPC side (:mod:`appliance.adapters.grpc.calls`)."""

    def open(self, connection: Connection, stream: Stream) -> None: ...


class _Block:
    """A header block being received in HEADERS + CONTINUATION frames."""

    __slots__ = ("block", "flags", "frames", "looped", "sid", "started")

    def __init__(self, sid: int, flags: int, block: memoryview, looped: bool, now: float):
        self.sid, self.flags, self.block, self.looped = sid, flags, bytearray(block), looped
        self.frames, self.started = 1, now


class Connection(Control):
    """One HTTP/2 connection from a gRPC client."""

    def __init__(
        self,
        handler: Handler,
        max_message: int,
        on_close: Callable[[Connection], None],
        limits: H2Limits | None = None,
    ):
        super().__init__(limits or H2Limits(), on_close)
        self.handler = handler
        self.max_message = max_message
        self._headers = HeaderDecoder(self.limits.header_block_limit)
        self._continuation: _Block | None = None
        # read once: every HEADERS and DATA frame compares against them
        self._block_limit = self.limits.header_block_limit
        self._half_window = self.limits.stream_window // 2

    def _headers_frame(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "a HEADERS frame on stream 0")
        if flags & PADDED:
            payload = unpad(flags, payload)
        looped = False
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError(FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority")
            looped = int.from_bytes(payload[:4], "big") & MAX_WINDOW == sid
            payload = payload[5:]
        if flags & END_HEADERS:
            self._end_headers(sid, flags, payload, looped)
            return
        if not payload:
            self._spend("empty header fragments")
        self._continuation = _Block(sid, flags, payload, looped, asyncio.get_running_loop().time())
        self._check_block(self._continuation)

    def _continue(self, flags: int, sid: int, payload: memoryview) -> None:
        cont = self._continuation
        if cont is None or cont.sid != sid:
            raise ProtocolError(PROTOCOL_ERROR, "a CONTINUATION without its HEADERS")
        cont.frames += 1
        cont.block += payload
        self._check_block(cont)
        if flags & END_HEADERS:
            self._continuation = None
            self._end_headers(sid, cont.flags, memoryview(cont.block), cont.looped)

    def _check_block(self, cont: _Block) -> None:
        most = self.limits.max_continuations
        if cont.frames > most:
            raise ProtocolError(ENHANCE_YOUR_CALM, f"a header block in more than {most} frames")
        if len(cont.block) > self._block_limit:
            raise ProtocolError(ENHANCE_YOUR_CALM, f"a header block over {self._block_limit} bytes")

    def _end_headers(self, sid: int, flags: int, block: memoryview, looped: bool) -> None:
        if len(block) > self._block_limit:
            raise ProtocolError(ENHANCE_YOUR_CALM, f"a header block over {self._block_limit} bytes")
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client
            trailers = self._headers.decode(bytes(block), trailers=True)
            if stream.ended:
                self._stream_error(stream, STREAM_CLOSED, "HEADERS after the end of the stream")
            elif not flags & END_STREAM:
                self._stream_error(stream, PROTOCOL_ERROR, "trailers without END_STREAM")
            elif trailers.malformed:
                self._stream_error(stream, PROTOCOL_ERROR, trailers.malformed)
            else:
                self._ended(stream)
            return
        if sid % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"a client stream with an even id {sid}")
        if sid <= self._last_stream:
            raise ProtocolError(
                PROTOCOL_ERROR, f"HEADERS on stream {sid}, not above {self._last_stream}"
            )
        request = self._headers.decode(bytes(block))
        self._last_stream = sid
        self._opened += 1
        limits = self.limits
        if looped:
            self._stream_error(sid, PROTOCOL_ERROR, "a stream that depends on itself")
        elif self.going_away:
            self._reset(sid, REFUSED_STREAM)  # the client may retry it elsewhere
        elif len(self.streams) + len(self._lingering) >= limits.max_concurrent_streams:
            self._reset(sid, REFUSED_STREAM)
            self._spend("streams over SETTINGS_MAX_CONCURRENT_STREAMS")
        elif request.malformed:
            self._stream_error(sid, PROTOCOL_ERROR, f"a malformed request: {request.malformed}")
        else:
            stream = Stream(sid, request.headers, self._peer_window, limits.stream_window)
            if request.size > limits.max_header_list_size:
                stream.oversize = request.size
            stream.ended = bool(flags & END_STREAM)
            self.streams[sid] = stream
            self.handler.open(self, stream)
            if stream.ended and not stream.closed:
                stream.call.end(False)

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        size = len(payload)  # flow control counts the whole payload, padding included
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "a DATA frame on stream 0")
        if flags & PADDED:
            payload = unpad(flags, payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        self._received += size
        if self._received > self._half_window and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
            self._recv_window += self._received
            self._received = 0
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on the idle stream {sid}")
            return  # a stream that was reset or answered: its data counts for the window only
        if stream.ended:
            self._stream_error(stream, STREAM_CLOSED, "DATA after the end of the stream")
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            self._stream_error(stream, FLOW_CONTROL_ERROR, "DATA past the stream's window")
            return
        if not payload and not flags & END_STREAM:
            self._spend("empty DATA frames")
        stream.owed += size
        buffer = stream.buffer
        if not buffer:  # messages that lie whole in this frame are taken straight from it
            taken = self._take(stream, payload)
            if taken < 0:
                return
            if taken < len(payload):  # the start of a message, admitted: the rest follows
                buffer += payload[taken:]
        else:
            buffer += payload
            with memoryview(buffer) as whole:
                taken = self._take(stream, whole)
            if taken < 0:
                return
            del buffer[:taken]
        if stream.owed > self._half_window:
            self._give_back(stream)
        if flags & END_STREAM:
            self._ended(stream)

    def _take(self, stream: Stream, data: memoryview) -> int:
        """Hand every whole gRPC message at the start of ``data`` to the stream's call;
        the bytes taken, or -1 when the call has answered (a message over the limit,
        one too many, or one whose queued bytes do not fit). Each message is admitted
        by the call (``call.admit``: its size checked, its queued bytes held) when its
        length prefix is read, before any of it is kept."""
        call = stream.call
        taken, end = 0, len(data)
        while True:
            if stream.skip:  # a message refused in its stream: dropped as it arrives
                dropped = min(stream.skip, end - taken)
                stream.skip -= dropped
                taken += dropped
            if end - taken < 5:
                break
            n = int.from_bytes(data[taken + 1 : taken + 5], "big")
            if not stream.admitted:
                verdict = call.admit(n)
                if verdict == REFUSED:
                    stream.skip = n
                    taken += 5
                    continue
                if verdict != ADMITTED:
                    stream.buffer = bytearray()  # (assigned: ``data`` may be a view of it)
                    return -1
                stream.admitted = True
            if end - taken < 5 + n:
                break
            stream.admitted = False
            if not call.unary:  # held until the call reads it (consumed)
                stream.owed -= 5 + n
            call.message(bytes(data[taken + 5 : taken + 5 + n]), data[taken])
            if stream.closed:
                return -1
            taken += 5 + n
        return taken

    def consumed(self, stream: Stream, size: int) -> None:
        """A streaming call read a message of ``size`` bytes (its prefix included): the
        client may send that much more (a slow model holds the client back)."""
        stream.owed += size
        self._give_back(stream)

    def _give_back(self, stream: Stream) -> None:
        owed = stream.owed
        if owed <= self._half_window or stream.ended or stream.closed:
            return  # (a closed stream takes no more frames, a window update neither)
        if self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, stream.id, struct.pack(">I", owed)))
            stream.recv_window += owed
            stream.owed = 0

    def _ended(self, stream: Stream) -> None:
        stream.ended = True
        stream.call.end(bool(stream.buffer) or stream.skip > 0)
        if stream.closed:  # answered before the client finished sending
            self.streams.pop(stream.id, None)
