"""The connection side of a gRPC client's HTTP/2 connection (:class:`Control`, the
base of :class:`appliance.adapters.grpc.h2.connection.Connection`): the connection's life
(preface, SETTINGS exchange, GOAWAY), the frames about the connection rather than a
request (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, PRIORITY, GOAWAY, unknown types),
each checked for its length, stream id and state (RFC 9113 section 6), the budget of
frames that serve no call (:class:`grpc_limits.Budget`) and the watchdog.

The watchdog looks at the connection every :attr:`H2Limits.tick_s` and closes it when
the client's preface and SETTINGS, or its acknowledgement of ours (SETTINGS_TIMEOUT),
did not come within ``read_timeout_s``; when a frame or a header block begun that long
ago is still unfinished (slowloris); when the client took nothing from a full write
buffer for that long (dropped: the GOAWAY could not reach it); and, with GOAWAY
NO_ERROR, when the connection has had no call for ``idle_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

from appliance.adapters.grpc.h2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    ENABLE_PUSH,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    INTERNAL_ERROR,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    WINDOW_UPDATE,
    FrameReader,
    ProtocolError,
    Stream,
    frame,
    settings,
)
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.adapters.grpc.h2.outbound import Outbound

log = logging.getLogger("appliance.adapters.grpc.h2.connection")


class Control(Outbound):
    """A connection's life and its connection-level frames; the stream frames (HEADERS,
    CONTINUATION, DATA) are the subclass's."""

    def __init__(self, limits: H2Limits, on_close: Callable[[Any], None]) -> None:
        super().__init__(limits)
        self._on_close = on_close
        self._reader = FrameReader()
        self._continuation: Any = None  # a header block under way (grpc_h2)
        self._recv_window = limits.connection_window  # what the client may still send
        self._received = 0  # connection-level bytes since the last WINDOW_UPDATE
        self._settled = False  # the client's SETTINGS followed its preface
        self._acked = False  # the client acknowledged the server's SETTINGS
        self._stalled = 0.0  # loop time since which part of a frame waits for the rest
        self._opened = self._opened_seen = 0  # streams opened: the idle watch sees calls
        self._quiet_since = 0.0  # loop time since which the connection has had no call
        self.created = time.monotonic()  # a TLS handshake may come before connection_made
        self.born = 0.0  # loop time of connection_made
        self._watch: asyncio.TimerHandle | None = None
        self.made = False  # connection_made was called (a TLS handshake succeeded)

    # the stream frames: methods of the one subclass, grpc_h2.Connection (flags, stream
    # id, payload); declared here for the frame dispatch below
    _data: Callable[[int, int, memoryview], None]
    _headers_frame: Callable[[int, int, memoryview], None]
    _continue: Callable[[int, int, memoryview], None]

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = self._transport_of(transport)
        self.made = True
        limits = self.limits
        mine = struct.pack(
            ">HIHIHI",
            MAX_CONCURRENT_STREAMS,
            limits.max_concurrent_streams,
            INITIAL_WINDOW_SIZE,
            limits.stream_window,
            MAX_HEADER_LIST_SIZE,
            limits.max_header_list_size,
        )
        opened = frame(SETTINGS, 0, 0, mine)
        if limits.connection_window > 65535:  # HTTP/2's initial connection window
            update = struct.pack(">I", limits.connection_window - 65535)
            opened += frame(WINDOW_UPDATE, 0, 0, update)
        transport.write(opened)
        loop = asyncio.get_running_loop()
        self.born = self._quiet_since = loop.time()
        self._watch = loop.call_later(limits.tick_s, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for handle in (self._watch, self._abort):
            if handle is not None:
                handle.cancel()
        for stream in list(self.streams.values()):
            self._drop(stream)
        self._reader = FrameReader()  # a frame or header block half received: dropped
        self._continuation = None
        self._wake()
        self._on_close(self)

    def resume_writing(self) -> None:
        if self._stalled:  # reading was paused meanwhile: the client was not late
            self._stalled = asyncio.get_running_loop().time()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # closing after an error: what the client sends now is dropped
        reader = self._reader
        try:
            count = 0
            for kind, flags, stream, payload in reader.frames(data):
                self._frame(kind, flags, stream, payload)
                count += 1
                if self.transport is None:
                    return
            if not reader.partial:
                self._stalled = 0.0
            elif count or not self._stalled:  # a new frame began in this read
                self._stalled = asyncio.get_running_loop().time()
        except ProtocolError as exc:
            log.info("grpc: closing a connection that broke HTTP/2: %.300s", exc)
            self.close(exc.code, str(exc)[:200])
        except Exception:  # a bug: this connection ends, every other one goes on
            log.exception("grpc: an unexpected error on a connection; closing it")
            self.close(INTERNAL_ERROR, "internal error")

    # ---- the watchdog ----------------------------------------------------------------

    def _tick(self) -> None:
        self._watch = None
        if self.transport is None:
            return
        limits = self.limits
        now = asyncio.get_running_loop().time()
        late = now - self.born - limits.read_timeout_s >= 0
        why, code = "", NO_ERROR
        if late and not self._settled:
            why = "no HTTP/2 preface and SETTINGS within the read timeout"
        elif late and not self._acked:
            why, code = "the server's SETTINGS were not acknowledged in time", SETTINGS_TIMEOUT
        elif self._stalled and not self._paused and now - self._stalled >= limits.read_timeout_s:
            why = "a frame was begun and not finished within the read timeout"
        elif (cont := self._continuation) and now - cont.started >= limits.read_timeout_s:
            why = "a header block was begun and not finished within the read timeout"
        elif self._write_stalled(now):
            log.info("grpc: dropping a connection whose client stopped reading")
            self.transport.abort()
            return
        if why:
            log.info("grpc: closing a connection: %s", why)
            self.close(code, why)
            return
        if self.streams or self.calls or self._opened != self._opened_seen:
            self._opened_seen = self._opened
            self._quiet_since = now
        elif now - self._quiet_since >= limits.idle_timeout_s and not self.going_away:
            self.goaway()  # no streams: closes now
            return
        self._watch = asyncio.get_running_loop().call_later(limits.tick_s, self._tick)

    # ---- inbound frames --------------------------------------------------------------

    def _spend(self, what: str) -> None:
        if not self._budget.spend():
            raise ProtocolError(ENHANCE_YOUR_CALM, f"too many {what}")

    def _idle(self, sid: int) -> bool:
        """No stream ``sid`` was ever opened (even ids: the server opens none)."""
        return sid % 2 == 0 or sid > self._last_stream

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "a header block was interrupted")
        if not self._settled:
            if kind != SETTINGS or flags & ACK:
                raise ProtocolError(PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
            self._settled = True
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers_frame(flags, sid, payload)
        elif kind == CONTINUATION:
            self._continue(flags, sid, payload)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid:
                raise ProtocolError(PROTOCOL_ERROR, "a PING on a stream")
            if len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR, "a PING of a bad length")
            if not flags & ACK and self.transport is not None:  # (the server sends none)
                self._spend("PING frames")
                self.transport.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._rst_stream(sid, payload)
        elif kind == PRIORITY:
            self._priority(sid, payload)
        elif kind == GOAWAY:
            if sid:
                raise ProtocolError(PROTOCOL_ERROR, "a GOAWAY on a stream")
            self.going_away = True  # the client opens no more streams
            if not self.streams:
                self.close()
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "a client may not push")
        else:  # unknown frame types are ignored (RFC 9113 5.5), but not for free
            self._spend("frames of unknown types")

    def _settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid:
            raise ProtocolError(PROTOCOL_ERROR, "a SETTINGS frame on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            self._acked = True
            return
        self._spend("SETTINGS frames")
        window = None
        for key, value in settings(payload, self.limits.max_settings):
            if key == ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                window = value
            elif key == MAX_FRAME_SIZE:
                if not MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, "a bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_frame = value
        if window is not None:  # applies to every open stream (only the last one counts)
            delta, self._peer_window = window - self._peer_window, window
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
        assert self.transport is not None
        self.transport.write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE of a bad length")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if sid == 0:
            if not increment:
                raise ProtocolError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "the connection window overflowed")
            self._flush_all()
            return
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(PROTOCOL_ERROR, f"a WINDOW_UPDATE on the idle stream {sid}")
            return  # a closed stream: late, ignored
        if not increment:
            self._stream_error(stream, PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(stream, FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
        elif stream.pending:
            self._flush(stream)

    def _rst_stream(self, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "a RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "a RST_STREAM of a bad length")
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(PROTOCOL_ERROR, f"a RST_STREAM on the idle stream {sid}")
            return
        self._drop(stream)
        self._spend("streams reset by the client")

    def _priority(self, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "a PRIORITY on stream 0")
        self._spend("PRIORITY frames")
        if len(payload) != 5:
            self._stream_error(sid, FRAME_SIZE_ERROR, "a PRIORITY of a bad length")
        elif int.from_bytes(payload[:4], "big") & MAX_WINDOW == sid:
            self._stream_error(sid, PROTOCOL_ERROR, "a stream that depends on itself")

    def _stream_error(self, stream: Stream | int, code: int, why: str) -> None:
        """RST_STREAM for a stream whose rules the client broke; the connection goes on."""
        log.debug("grpc: stream error %d: %s", code, why)
        if isinstance(stream, Stream):
            self.reset(stream, code)
        else:
            self._reset(stream, code)
            if (open_stream := self.streams.get(stream)) is not None:
                self._drop(open_stream)
        self._spend("stream errors")
