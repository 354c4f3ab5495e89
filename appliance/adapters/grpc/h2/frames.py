"""HTTP/2's pieces for the gRPC endpoint (RFC 9113): frame types, flags and error
codes, reading frames off the byte stream and writing them, SETTINGS payloads, and one
stream's record. Header blocks are :mod:`appliance.adapters.grpc.h2.headers`'; the
state machine that uses all of them is :mod:`appliance.adapters.grpc.h2.machine`.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Iterator
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
SETTINGS_TIMEOUT, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 4, 5, 6, 7, 8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 1, 2, 3, 4
MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 5, 6
MAX_WINDOW = 2**31 - 1
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the default, which this server keeps


def frame(kind: int, flags: int, stream: int, payload: bytes | memoryview = b"") -> bytes:
    return data_head(kind, flags, stream, len(payload)) + bytes(payload)


def data_head(kind: int, flags: int, stream: int, n: int) -> bytes:
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, stream)


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", code))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream, code) + debug[:256])


class ProtocolError(Exception):
    """A connection error: the connection ends with GOAWAY carrying ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream:
    """One request stream: its headers, its inbound gRPC messages, both windows."""

    __slots__ = (
        "admitted",
        "buffer",
        "call",
        "closed",
        "ended",
        "headers",
        "id",
        "oversize",
        "owed",
        "pending",
        "recv_window",
        "send_window",
        "skip",
    )

    def __init__(
        self, stream_id: int, headers: list[tuple[str, str]], window: int, receive: int
    ) -> None:
        self.id = stream_id
        self.headers = headers
        self.oversize = 0  # the header list's size when it is over the advertised limit
        self.buffer = bytearray()  # gRPC message bytes not yet complete
        self.admitted = False  # the message in ``buffer`` was admitted (its prefix read)
        self.skip = 0  # bytes of a message refused in its stream, still to drop
        self.call: Any = None  # the call serving it (grpc.calls): set by Handler.open
        self.ended = False  # the client sent END_STREAM
        self.closed = False  # we sent END_STREAM (or it was reset)
        self.send_window = window
        self.recv_window = receive  # what the client may still send before our next update
        # received bytes not given back yet, less those of messages a streaming call has
        # not read (negative while such messages were given back as they arrived)
        self.owed = 0
        # outbound bytes waiting for window: (data, end_stream, frames after the data)
        self.pending: collections.deque[tuple[memoryview, bool, bytes]] = collections.deque()


class FrameReader:
    """Frames off a connection's byte stream: the client's preface first, then each
    frame as (type, flags, stream id, payload), the payload a view of the bytes read
    (no copy); a frame cut between two reads is kept until the rest comes (at most one
    frame, 16 KiB + 9 bytes: a longer one is FRAME_SIZE_ERROR before it is read)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.preface = False  # the client's preface has been read

    @property
    def partial(self) -> bool:
        """Part of a frame (or of the preface) is waiting for the rest."""
        return bool(self._buffer)

    def frames(self, data: bytes) -> Iterator[tuple[int, int, int, memoryview]]:
        if self._buffer:
            data = b"".join((self._buffer, data))  # one copy of the two
            self._buffer.clear()
        if not self.preface:
            if not (PREFACE.startswith(data) or data.startswith(PREFACE)):
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if len(data) < len(PREFACE):
                self._buffer += data
                return
            data = data[len(PREFACE) :]
            self.preface = True
        view = memoryview(data)
        offset, end = 0, len(data)
        while end - offset >= 9:
            length = data[offset] << 16 | data[offset + 1] << 8 | data[offset + 2]
            if length > MAX_FRAME:
                raise ProtocolError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if end - offset < 9 + length:
                break
            kind, flags = data[offset + 3], data[offset + 4]
            stream = int.from_bytes(data[offset + 5 : offset + 9], "big") & MAX_WINDOW
            start, offset = offset + 9, offset + 9 + length
            yield kind, flags, stream, view[start:offset]
        if offset < end:
            self._buffer += view[offset:]


def settings(payload: memoryview, most: int) -> list[tuple[int, int]]:
    """The (identifier, value) pairs of a SETTINGS frame, at most ``most`` of them."""
    if len(payload) % 6:
        raise ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS frame of a bad length")
    if len(payload) > 6 * most:
        raise ProtocolError(ENHANCE_YOUR_CALM, f"a SETTINGS frame of more than {most} entries")
    return [struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6)]


def unpad(flags: int, payload: memoryview) -> memoryview:
    """A DATA or HEADERS payload without its padding (RFC 9113 6.1, 6.2)."""
    if not flags & PADDED:
        return payload
    if not payload:
        raise ProtocolError(FRAME_SIZE_ERROR, "a padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError(
            PROTOCOL_ERROR, f"{pad} bytes of padding in a {len(payload)}-byte frame"
        )
    return payload[1 : len(payload) - pad]
