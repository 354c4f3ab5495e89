"""HTTP/2 for gRPC as a sans-I/O state machine (:class:`Machine`): bytes in, the calls
told of their streams and messages, bytes out. It reads no socket and no clock: the
driver (:mod:`appliance.adapters.grpc.h2.connection`) feeds what a client sent with the
loop's time, writes what :attr:`Machine.out` queued, and asks the watchdog's questions.
It reads what a client sends (RFC 9113), no more than a gRPC server needs, and trusts
none of it:

- frames: the preface, then SETTINGS first; SETTINGS (the peer's window and frame size
  honoured, acknowledged), PING (answered), WINDOW_UPDATE, HEADERS with CONTINUATION,
  DATA, RST_STREAM (cancels the call), GOAWAY (both ways), PRIORITY (checked, else
  ignored); each frame's length, stream id and state rules are checked, and a frame on
  an idle stream, a stream id that does not increase or an even one is PROTOCOL_ERROR;
- flow control: what the client sends is counted against the windows the server
  granted (FLOW_CONTROL_ERROR past them); a unary call's window is given back as its
  message arrives, a streaming call's as it reads its requests (the receiving side,
  DATA and the messages cut out of it, is :mod:`~appliance.adapters.grpc.h2.inbound`'s);
- limits (:class:`H2Limits`): concurrent streams, header block size and frames, a
  budget of frames that serve no call (:class:`Budget`), the watchdog's rules
  (:class:`Watch`).

What a call does with its messages is :mod:`appliance.adapters.grpc.calls`'s business:
the machine hands it each new stream (``Handler.open``), each gRPC message once its
length prefix is read (``call.admit``, before any of it is kept) and once whole
(``call.message``), the end of the stream (``call.end``) and a reset (``call.cancel``).
A stream error ends that stream with RST_STREAM; a connection error ends the connection
with GOAWAY and its error code (:attr:`Machine.closing`).
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Protocol

from appliance.adapters.grpc.h2 import frames as f
from appliance.adapters.grpc.h2.frames import ProtocolError, Stream, frame
from appliance.adapters.grpc.h2.headers import HeaderDecoder, PendingBlock
from appliance.adapters.grpc.h2.inbound import ADMITTED, OVER, REFUSED, Inbound
from appliance.adapters.grpc.h2.limits import Budget, H2Limits
from appliance.adapters.grpc.h2.outbound import Outbound
from appliance.adapters.grpc.h2.watch import Watch

log = logging.getLogger("appliance.adapters.grpc.h2.connection")

__all__ = ["ADMITTED", "OVER", "REFUSED", "Handler", "Machine"]


class Handler(Protocol):
    """The gRPC side (:mod:`appliance.adapters.grpc.dispatch`)."""

    def open(self, connection: Any, stream: Stream) -> None: ...


class Machine:
    """One HTTP/2 connection's state. ``owner`` is what the handler's calls are given
    as their connection (the driver: they send and wait through it)."""

    def __init__(self, handler: Handler, limits: H2Limits, owner: Any) -> None:
        self.handler, self.limits, self.owner = handler, limits, owner
        self.streams: dict[int, Stream] = {}
        self.lingering: set[Any] = set()  # calls of dropped streams, unwinding (tasks)
        self.out = Outbound(self._finished)
        self.watch = Watch(limits)
        self.going_away = False
        self.closing: tuple[int, str] | None = None  # (GOAWAY's code, why) once it ends
        self._reader = f.FrameReader()
        self._headers = HeaderDecoder(limits.header_block_limit)
        self._continuation: PendingBlock | None = None
        self._budget = Budget(limits.flood_burst, limits.flood_rate)
        self._last_stream = 0
        self._now = 0.0  # the time of the read being handled
        self._block_limit = limits.header_block_limit  # read once: every HEADERS compares
        self.inbound = Inbound(
            limits, self.out, self.streams, self._idle, self._stream_error, self._spend
        )
        self._data = self.inbound.data  # bound once: every DATA frame calls it

    # ---- the driver's calls ----------------------------------------------------------

    def start(self, now: float) -> None:
        """The connection is made: the server's SETTINGS (and the connection window)."""
        limits = self.limits
        mine = struct.pack(
            ">HIHIHI",
            f.MAX_CONCURRENT_STREAMS,
            limits.max_concurrent_streams,
            f.INITIAL_WINDOW_SIZE,
            limits.stream_window,
            f.MAX_HEADER_LIST_SIZE,
            limits.max_header_list_size,
        )
        self.out.write(frame(f.SETTINGS, 0, 0, mine))
        if limits.connection_window > 65535:  # HTTP/2's initial connection window
            update = struct.pack(">I", limits.connection_window - 65535)
            self.out.write(frame(f.WINDOW_UPDATE, 0, 0, update))
        self.watch.start(now)

    def receive(self, data: bytes, now: float) -> None:
        """What the client sent, read at ``now``."""
        if self.closing is not None:
            return  # closing after an error: what the client sends now is dropped
        self._now = now
        reader = self._reader
        try:
            count = 0
            for kind, flags, stream, payload in reader.frames(data):
                self._frame(kind, flags, stream, payload)
                count += 1
                if self.closing is not None:
                    return
            self.watch.read(reader.partial, count, now)
        except ProtocolError as exc:
            log.info("grpc: closing a connection that broke HTTP/2: %.300s", exc)
            self.close(exc.code, str(exc)[:200])
        except Exception:  # a bug: this connection ends, every other one goes on
            log.exception("grpc: an unexpected error on a connection; closing it")
            self.close(f.INTERNAL_ERROR, "internal error")

    def overdue(self, now: float, paused: bool) -> tuple[str, int]:
        block = self._continuation
        return self.watch.overdue(now, paused, block.started if block is not None else None)

    def idle(self, now: float, busy: bool) -> bool:
        return not self.going_away and self.watch.idle(now, busy or bool(self.streams))

    def reset(self, stream: Stream, code: int = f.CANCEL) -> None:
        """End ``stream`` at once with RST_STREAM (its call gave up, or the client broke
        the stream's rules)."""
        if self.streams.get(stream.id) is not stream:
            return  # already over (answered, or reset before)
        self.out.write(f.rst_stream(stream.id, code))
        self._drop(stream)

    def goaway(self) -> None:
        """No new streams (shutting down, or idle); the connection closes once its
        streams end."""
        if self.closing is not None:
            return
        self.going_away = True
        self.out.write(f.goaway(self._last_stream, f.NO_ERROR))
        if not self.streams:
            self.close()

    def close(self, code: int = f.NO_ERROR, debug: str = "") -> None:
        """End the connection (GOAWAY with ``code`` first, unless it ends gracefully);
        every call still running is cancelled."""
        if self.closing is not None:
            return
        if code != f.NO_ERROR or debug:
            self.out.write(f.goaway(self._last_stream, code, debug.encode("utf-8", "replace")))
        self.closing = (code, debug)
        self.out.open = False
        for stream in list(self.streams.values()):
            self._drop(stream)
        self.out.blocked.clear()

    def lost(self) -> None:
        """The connection is gone: its streams and half-received frames are dropped."""
        self.closing = self.closing or (f.NO_ERROR, "")
        self.out.open = False
        self.out.queue = []
        for stream in list(self.streams.values()):
            self._drop(stream)
        self._reader = f.FrameReader()
        self._continuation = None

    # ---- streams ---------------------------------------------------------------------

    def _finished(self, stream: Stream) -> None:
        """We sent END_STREAM: the stream is over (told to stop sending if the client
        has not finished), and the call it served earns the connection's budget back."""
        self._budget.earn(self.limits.flood_refund)
        stream.buffer = bytearray()  # what the client still sends is dropped
        if not stream.ended and self.streams.get(stream.id) is stream:
            self.out.write(f.rst_stream(stream.id, f.NO_ERROR))  # stop the client sending
        self.streams.pop(stream.id, None)
        self.out.blocked.pop(stream.id, None)
        if self.going_away and not self.streams:
            self.close()

    def _drop(self, stream: Stream) -> None:
        """Forget ``stream`` now; its call is cancelled and, until it has unwound, still
        counts against the concurrent streams (so resets do not make room: Rapid Reset)."""
        stream.closed = True
        stream.pending.clear()
        stream.buffer = bytearray()  # a message half received is dropped with its memory
        self.streams.pop(stream.id, None)
        self.out.blocked.pop(stream.id, None)
        if stream.call is not None:
            task = stream.call.cancel()
            if task is not None:
                self.lingering.add(task)
                task.add_done_callback(self.lingering.discard)

    def _stream_error(self, stream: Stream | int, code: int, why: str) -> None:
        """RST_STREAM for a stream whose rules the client broke; the connection goes on."""
        log.debug("grpc: stream error %d: %s", code, why)
        if isinstance(stream, Stream):
            self.reset(stream, code)
        else:
            self.out.write(f.rst_stream(stream, code))
            if (open_stream := self.streams.get(stream)) is not None:
                self._drop(open_stream)
        self._spend("stream errors")

    def _spend(self, what: str) -> None:
        if not self._budget.spend():
            raise ProtocolError(f.ENHANCE_YOUR_CALM, f"too many {what}")

    def _idle(self, sid: int) -> bool:
        """No stream ``sid`` was ever opened (even ids: the server opens none)."""
        return sid % 2 == 0 or sid > self._last_stream

    # ---- frames ----------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self._continuation is not None and kind != f.CONTINUATION:
            raise ProtocolError(f.PROTOCOL_ERROR, "a header block was interrupted")
        if not self.watch.settled:
            if kind != f.SETTINGS or flags & f.ACK:
                raise ProtocolError(f.PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
            self.watch.settled = True
        if kind == f.DATA:
            self._data(flags, sid, payload)
        elif kind == f.HEADERS:
            self._headers_frame(flags, sid, payload)
        elif kind == f.CONTINUATION:
            self._continue(flags, sid, payload)
        elif kind == f.SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == f.WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == f.PING:
            if sid:
                raise ProtocolError(f.PROTOCOL_ERROR, "a PING on a stream")
            if len(payload) != 8:
                raise ProtocolError(f.FRAME_SIZE_ERROR, "a PING of a bad length")
            if not flags & f.ACK:  # (the server sends none)
                self._spend("PING frames")
                self.out.write(frame(f.PING, f.ACK, 0, payload))
        elif kind == f.RST_STREAM:
            self._rst_stream(sid, payload)
        elif kind == f.PRIORITY:
            self._priority(sid, payload)
        elif kind == f.GOAWAY:
            if sid:
                raise ProtocolError(f.PROTOCOL_ERROR, "a GOAWAY on a stream")
            self.going_away = True  # the client opens no more streams
            if not self.streams:
                self.close()
        elif kind == f.PUSH_PROMISE:
            raise ProtocolError(f.PROTOCOL_ERROR, "a client may not push")
        else:  # unknown frame types are ignored (RFC 9113 5.5), but not for free
            self._spend("frames of unknown types")

    def _settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid:
            raise ProtocolError(f.PROTOCOL_ERROR, "a SETTINGS frame on a stream")
        if flags & f.ACK:
            if payload:
                raise ProtocolError(f.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            self.watch.acked = True
            return
        self._spend("SETTINGS frames")
        window = None
        for key, value in f.settings(payload, self.limits.max_settings):
            if key == f.ENABLE_PUSH and value > 1:
                raise ProtocolError(f.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise ProtocolError(f.FLOW_CONTROL_ERROR, "a window over 2^31-1")
                window = value
            elif key == f.MAX_FRAME_SIZE:
                if not f.MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(f.PROTOCOL_ERROR, "a bad SETTINGS_MAX_FRAME_SIZE")
                self.out.peer_frame = value
        if window is not None:  # applies to every open stream (only the last one counts)
            self.out.initial_window(window, self.streams)
        self.out.write(frame(f.SETTINGS, f.ACK, 0))
        self.out.flush_all()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ProtocolError(f.FRAME_SIZE_ERROR, "a WINDOW_UPDATE of a bad length")
        increment = int.from_bytes(payload, "big") & f.MAX_WINDOW
        if sid == 0:
            if not increment:
                raise ProtocolError(f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.out.granted(increment)
            return
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(f.PROTOCOL_ERROR, f"a WINDOW_UPDATE on the idle stream {sid}")
            return  # a closed stream: late, ignored
        if not increment:
            self._stream_error(stream, f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            return
        stream.send_window += increment
        if stream.send_window > f.MAX_WINDOW:
            self._stream_error(stream, f.FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
        elif stream.pending:
            self.out.flush(stream)

    def _rst_stream(self, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(f.PROTOCOL_ERROR, "a RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolError(f.FRAME_SIZE_ERROR, "a RST_STREAM of a bad length")
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(f.PROTOCOL_ERROR, f"a RST_STREAM on the idle stream {sid}")
            return
        self._drop(stream)
        self._spend("streams reset by the client")

    def _priority(self, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(f.PROTOCOL_ERROR, "a PRIORITY on stream 0")
        self._spend("PRIORITY frames")
        if len(payload) != 5:
            self._stream_error(sid, f.FRAME_SIZE_ERROR, "a PRIORITY of a bad length")
        elif int.from_bytes(payload[:4], "big") & f.MAX_WINDOW == sid:
            self._stream_error(sid, f.PROTOCOL_ERROR, "a stream that depends on itself")

    # ---- header blocks -------------------------------------------------------------

    def _headers_frame(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(f.PROTOCOL_ERROR, "a HEADERS frame on stream 0")
        if flags & f.PADDED:
            payload = f.unpad(flags, payload)
        looped = False
        if flags & f.PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError(
                    f.FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority"
                )
            looped = int.from_bytes(payload[:4], "big") & f.MAX_WINDOW == sid
            payload = payload[5:]
        if flags & f.END_HEADERS:
            self._end_headers(sid, flags, payload, looped)
            return
        if not payload:
            self._spend("empty header fragments")
        self._continuation = PendingBlock(sid, flags, payload, looped, self._now)
        self._check_block(self._continuation)

    def _continue(self, flags: int, sid: int, payload: memoryview) -> None:
        cont = self._continuation
        if cont is None or cont.sid != sid:
            raise ProtocolError(f.PROTOCOL_ERROR, "a CONTINUATION without its HEADERS")
        cont.frames += 1
        cont.block += payload
        self._check_block(cont)
        if flags & f.END_HEADERS:
            self._continuation = None
            self._end_headers(sid, cont.flags, memoryview(cont.block), cont.looped)

    def _check_block(self, cont: PendingBlock) -> None:
        most = self.limits.max_continuations
        if cont.frames > most:
            raise ProtocolError(f.ENHANCE_YOUR_CALM, f"a header block in more than {most} frames")
        if len(cont.block) > self._block_limit:
            raise ProtocolError(
                f.ENHANCE_YOUR_CALM, f"a header block over {self._block_limit} bytes"
            )

    def _end_headers(self, sid: int, flags: int, block: memoryview, looped: bool) -> None:
        if len(block) > self._block_limit:
            raise ProtocolError(
                f.ENHANCE_YOUR_CALM, f"a header block over {self._block_limit} bytes"
            )
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client
            trailers = self._headers.decode(bytes(block), trailers=True)
            if stream.ended:
                self._stream_error(stream, f.STREAM_CLOSED, "HEADERS after the end of the stream")
            elif not flags & f.END_STREAM:
                self._stream_error(stream, f.PROTOCOL_ERROR, "trailers without END_STREAM")
            elif trailers.malformed:
                self._stream_error(stream, f.PROTOCOL_ERROR, trailers.malformed)
            else:
                self.inbound.ended(stream)
            return
        if sid % 2 == 0:
            raise ProtocolError(f.PROTOCOL_ERROR, f"a client stream with an even id {sid}")
        if sid <= self._last_stream:
            raise ProtocolError(
                f.PROTOCOL_ERROR, f"HEADERS on stream {sid}, not above {self._last_stream}"
            )
        request = self._headers.decode(bytes(block))
        self._last_stream = sid
        self.watch.opened += 1
        limits = self.limits
        if looped:
            self._stream_error(sid, f.PROTOCOL_ERROR, "a stream that depends on itself")
        elif self.going_away:
            self.out.write(f.rst_stream(sid, f.REFUSED_STREAM))  # the client may retry it
        elif len(self.streams) + len(self.lingering) >= limits.max_concurrent_streams:
            self.out.write(f.rst_stream(sid, f.REFUSED_STREAM))
            self._spend("streams over SETTINGS_MAX_CONCURRENT_STREAMS")
        elif request.malformed:
            self._stream_error(sid, f.PROTOCOL_ERROR, f"a malformed request: {request.malformed}")
        else:
            stream = Stream(sid, request.headers, self.out.peer_window, limits.stream_window)
            if request.size > limits.max_header_list_size:
                stream.oversize = request.size
            stream.ended = bool(flags & f.END_STREAM)
            self.streams[sid] = stream
            self.handler.open(self.owner, stream)
            if stream.ended and not stream.closed:
                stream.call.end(False)
