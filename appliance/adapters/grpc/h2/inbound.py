"""The receiving side of one HTTP/2 connection, without I/O (:class:`Inbound`): DATA
counted against the windows the server granted (FLOW_CONTROL_ERROR past them), the
gRPC messages cut out of it and handed to the stream's call, and the windows given back:
a unary call's as its message arrives, a streaming call's as it reads its requests
(:meth:`Inbound.consumed`). :class:`~appliance.adapters.grpc.h2.machine.Machine` owns
one and hands it every DATA frame.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from appliance.adapters.grpc.h2 import frames as f
from appliance.adapters.grpc.h2.frames import ProtocolError, Stream, frame
from appliance.adapters.grpc.h2.limits import H2Limits
from appliance.adapters.grpc.h2.outbound import Outbound

# what a call says of a message whose length prefix came (Handler's call.admit)
ADMITTED, OVER, REFUSED = 1, 0, -1  # kept; the call answered; refused in its stream


class Inbound:
    """What the client sends on its streams, and the windows it may send in.

    ``streams`` is the machine's (the same dict); ``idle(sid)``: no stream ``sid`` was
    ever opened; ``stream_error(stream, code, why)`` resets a stream whose rules the
    client broke; ``spend(what)`` charges the connection's budget."""

    __slots__ = (
        "_half_window",
        "_idle",
        "_received",
        "_spend",
        "_stream_error",
        "_window",
        "out",
        "streams",
    )

    def __init__(
        self,
        limits: H2Limits,
        out: Outbound,
        streams: dict[int, Stream],
        idle: Callable[[int], bool],
        stream_error: Callable[[Stream, int, str], None],
        spend: Callable[[str], None],
    ) -> None:
        self.out, self.streams = out, streams
        self._idle, self._stream_error, self._spend = idle, stream_error, spend
        self._window = limits.connection_window  # what the client may still send
        self._received = 0  # connection-level bytes since the last WINDOW_UPDATE
        self._half_window = limits.stream_window // 2  # read once: every DATA frame compares

    def consumed(self, stream: Stream, size: int) -> None:
        """A streaming call read a message of ``size`` bytes (its prefix included): the
        client may send that much more (a slow model holds the client back)."""
        stream.owed += size
        self._give_back(stream)

    def data(self, flags: int, sid: int, payload: memoryview) -> None:
        """A DATA frame for stream ``sid``: counted against the windows, its messages
        handed to the stream's call."""
        size = len(payload)  # flow control counts the whole payload, padding included
        if sid == 0:
            raise ProtocolError(f.PROTOCOL_ERROR, "a DATA frame on stream 0")
        if flags & f.PADDED:
            payload = f.unpad(flags, payload)
        self._window -= size
        if self._window < 0:
            raise ProtocolError(f.FLOW_CONTROL_ERROR, "DATA past the connection's window")
        self._received += size
        if self._received > self._half_window:
            update = struct.pack(">I", self._received)
            self.out.write(frame(f.WINDOW_UPDATE, 0, 0, update))
            self._window += self._received
            self._received = 0
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                raise ProtocolError(f.PROTOCOL_ERROR, f"DATA on the idle stream {sid}")
            return  # a stream that was reset or answered: its data counts for the window only
        if stream.ended:
            self._stream_error(stream, f.STREAM_CLOSED, "DATA after the end of the stream")
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            self._stream_error(stream, f.FLOW_CONTROL_ERROR, "DATA past the stream's window")
            return
        if not payload and not flags & f.END_STREAM:
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
        if flags & f.END_STREAM:
            self.ended(stream)

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

    def _give_back(self, stream: Stream) -> None:
        owed = stream.owed
        if owed <= self._half_window or stream.ended or stream.closed or not self.out.open:
            return  # (a closed stream takes no more frames, a window update neither; the
            # output closes with the connection, when the machine's ``closing`` is set)
        self.out.write(frame(f.WINDOW_UPDATE, 0, stream.id, struct.pack(">I", owed)))
        stream.recv_window += owed
        stream.owed = 0

    def ended(self, stream: Stream) -> None:
        """The client ended ``stream`` (END_STREAM, or its trailers)."""
        stream.ended = True
        stream.call.end(bool(stream.buffer) or stream.skip > 0)
        if stream.closed:  # answered before the client finished sending
            self.streams.pop(stream.id, None)
