"""The sending side of one HTTP/2 connection, without I/O (:class:`Outbound`): what
the server writes is queued as bytes, DATA within the client's windows and split at its
frame size, and the driver (:mod:`appliance.adapters.grpc.h2.connection`) takes the
queue once per turn and writes it in one call.

What the server holds for a client that does not read is bounded: outbound DATA waits
in its stream for window (at most what a call produced); past the transport's
high-water mark the driver stops *reading*, so a client that sends requests or PINGs
without reading their answers makes the server do no more work.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.adapters.grpc.h2.frames import (
    DATA,
    FLOW_CONTROL_ERROR,
    MAX_WINDOW,
    ProtocolError,
    Stream,
    data_head,
)


class Outbound:
    """The bytes to send, and the windows the client granted for them.

    ``finished(stream)`` is told when a stream's END_STREAM has been queued."""

    __slots__ = ("_finished", "blocked", "open", "peer_frame", "peer_window", "queue", "window")

    def __init__(self, finished: Callable[[Stream], None]) -> None:
        self._finished = finished
        self.queue: list[bytes | memoryview] = []  # written by the driver, in order
        self.open = True  # False once the connection ends: nothing more is queued
        self.blocked: dict[int, Stream] = {}  # streams whose data waits for window
        self.window = 65535  # the connection's send window, as the client grants it
        self.peer_window = 65535  # the initial window of each new stream
        self.peer_frame = 16384  # the client's SETTINGS_MAX_FRAME_SIZE

    def write(self, chunk: bytes | memoryview) -> None:
        if self.open:
            self.queue.append(chunk)

    def take(self) -> list[bytes | memoryview]:
        """What is queued, in order; the queue is empty after."""
        queue, self.queue = self.queue, []
        return queue

    def send(
        self, stream: Stream, head: bytes, data: bytes | memoryview, tail: bytes, end: bool
    ) -> None:
        """Queue ``head`` (a HEADERS frame or nothing), ``data`` as DATA frames within
        the windows and ``tail`` (frames, e.g. trailers) after all of the data; what
        does not fit waits for WINDOW_UPDATE. ``end``: the stream is done after it."""
        if not self.open or stream.closed:
            return
        view = memoryview(data).cast("B") if len(data) else memoryview(b"")
        stream.pending.append((view, end, tail))
        if head:
            self.queue.append(head)
        self.flush(stream)

    def flush(self, stream: Stream) -> None:
        """Queue what of ``stream``'s waiting data the windows let through."""
        out = self.queue
        while stream.pending and self.open:
            view, end, tail = stream.pending[0]
            while len(view):
                room = min(self.window, stream.send_window, self.peer_frame)
                if room <= 0:
                    break
                piece = view[:room]
                out.append(data_head(DATA, 0, stream.id, len(piece)))
                out.append(piece)
                view = view[len(piece) :]
                self.window -= len(piece)
                stream.send_window -= len(piece)
            if len(view):
                stream.pending[0] = (view, end, tail)
                self.blocked[stream.id] = stream
                break
            stream.pending.popleft()
            if tail:
                out.append(tail)
            if end:
                stream.closed = True
                self._finished(stream)
        if not stream.pending and self.blocked:
            self.blocked.pop(stream.id, None)

    def flush_all(self) -> None:
        for stream in list(self.blocked.values()):
            self.flush(stream)

    def granted(self, increment: int) -> None:
        """A WINDOW_UPDATE for the connection."""
        self.window += increment
        if self.window > MAX_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "the connection window overflowed")
        self.flush_all()

    def initial_window(self, window: int, streams: dict[int, Stream]) -> None:
        """SETTINGS_INITIAL_WINDOW_SIZE changed: it applies to every open stream."""
        delta, self.peer_window = window - self.peer_window, window
        for stream in streams.values():
            stream.send_window += delta
            if stream.send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
