"""HTTP/2's pieces for the gRPC endpoint (RFC 9113): frame types, flags and error
codes, reading frames off the byte stream and writing them, one stream's record, and
header-block decoding.

Header blocks are decoded by ``hpack`` with its dynamic table kept per connection;
blocks made of indexed fields only (one byte each, no table change: what a client sends
for the second and every later call on a connection) come from a cache.
:mod:`appliance.adapters.grpc_h2` is the connection that uses them.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Iterator
from typing import Any

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, CANCEL = 0, 1, 3, 6, 8
ENHANCE_YOUR_CALM, COMPRESSION_ERROR = 11, 9
MAX_WINDOW = 2**31 - 1
RECEIVE_WINDOW = 16 * 2**20  # per stream; the connection's is opened to MAX_WINDOW
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the default, which this server keeps
MAX_HEADER_BLOCK = 64 * 1024
MAX_STREAMS = 256  # concurrent streams a client may open on one connection


def frame(kind: int, flags: int, stream: int, payload: bytes | memoryview = b"") -> bytes:
    n = len(payload)
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, stream) + bytes(payload)


def data_head(kind: int, flags: int, stream: int, n: int) -> bytes:
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, stream)


class ProtocolError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream:
    """One request stream: its headers, its inbound gRPC messages, its send window."""

    __slots__ = (
        "buffer",
        "call",
        "closed",
        "ended",
        "headers",
        "id",
        "pending",
        "received",
        "send_window",
    )

    def __init__(self, stream_id: int, headers: list[tuple[str, str]], window: int) -> None:
        self.id = stream_id
        self.headers = headers
        self.buffer = bytearray()  # gRPC message bytes not yet complete
        self.call: Any = None  # the call serving it (grpc_calls): set by Handler.open
        self.ended = False  # the client sent END_STREAM
        self.closed = False  # we sent END_STREAM (or it was reset)
        self.send_window = window
        self.received = 0  # DATA bytes consumed since the last WINDOW_UPDATE
        # outbound bytes waiting for window: (data, end_stream); trailers as bytes frames
        self.pending: collections.deque[tuple[memoryview, bool, bytes]] = collections.deque()


class FrameReader:
    """Frames off a connection's byte stream: the client's preface first, then each
    frame as (type, flags, stream id, payload), the payload a view of the bytes read
    (no copy); a frame cut between two reads is kept until the rest comes."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._preface = False

    def frames(self, data: bytes) -> Iterator[tuple[int, int, int, memoryview]]:
        if self._buffer:  # at most one frame (16 KiB + 9) waits here
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        if not self._preface:
            if not (PREFACE.startswith(data) or data.startswith(PREFACE)):
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if len(data) < len(PREFACE):
                self._buffer += data
                return
            data = data[len(PREFACE) :]
            self._preface = True
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


def settings(payload: memoryview) -> Iterator[tuple[int, int]]:
    """The (identifier, value) pairs of a SETTINGS frame."""
    if len(payload) % 6:
        raise ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS frame of a bad length")
    for i in range(0, len(payload), 6):
        yield struct.unpack_from(">HI", payload, i)


class HeaderDecoder:
    """One connection's header-block decoder (its hpack dynamic table and cache)."""

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_BLOCK
        self._indexed: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """A header block -> (name, value) pairs; COMPRESSION_ERROR when hpack refuses it."""
        hit = self._indexed.get(block)
        if hit is not None:
            return hit
        try:
            headers = self._decoder.decode(block)
        except Exception as exc:  # hpack's errors: the connection cannot go on
            raise ProtocolError(COMPRESSION_ERROR, f"a header block hpack refused: {exc}") from None
        decoded = [(str(k), str(v)) for k, v in headers]
        if all(b & 0x80 and b != 0xFF for b in block):
            if len(self._indexed) > 64:
                self._indexed.clear()
            self._indexed[block] = decoded
        else:  # the block may have changed the dynamic table: indexes mean other things now
            self._indexed.clear()
        return decoded
