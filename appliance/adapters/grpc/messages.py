"""What gRPC puts on the wire around a call's messages (grpc/grpc doc/PROTOCOL-HTTP2.md):
the server's header blocks (fixed literals: the server keeps no HPACK table), status
trailers, the 5-byte message prefix, ``grpc-timeout`` and compressed messages.

A compressed message (``grpc-encoding`` gzip or deflate, compressed flag 1) is inflated
to at most the message limit, counted as it inflates (a gzip bomb stops at the limit:
RESOURCE_EXHAUSTED), and must be one whole stream (truncated or trailing bytes:
INTERNAL). The first ``offload.OFFLOAD_BYTES`` of output come on the event loop, the
rest on a worker thread.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib

import grpc

from appliance.adapters.grpc.h2.frames import END_HEADERS, END_STREAM, HEADERS, frame
from appliance.adapters.offload import OFFLOAD_BYTES

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# grpc-encoding -> zlib's wbits (gzip's header, or zlib's as gRPC's "deflate")
ENCODINGS = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPTED = "identity,deflate,gzip"


def hpack_int(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in the low ``prefix`` bits after ``first``'s."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal without indexing, new name, no Huffman coding."""
    return b"\x00" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


def _percent(text: str) -> bytes:
    """grpc-message's percent-encoding: printable ASCII but '%' stays as it is."""
    raw = text.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


_CONTENT_TYPE = b"\x0f\x10" + hpack_int(16, 7, 0) + b"application/grpc"  # static name 31
# :status 200 (static index 8) and content-type application/grpc
RESPONSE_HEADERS = b"\x88" + _CONTENT_TYPE
OK_TRAILERS = literal(b"grpc-status", b"0")


def response_headers(status: int) -> bytes:
    """:status (a literal with the static name 8 when it is not 200) and content-type."""
    if status == 200:
        return RESPONSE_HEADERS
    return b"\x08" + hpack_int(3, 7, 0) + str(status).encode() + _CONTENT_TYPE


def trailers(code: grpc.StatusCode, details: str, accept: bool = False) -> bytes:
    block = literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        block += literal(b"grpc-message", _percent(details))
    if accept:  # an encoding the server cannot read: say which it can
        block += literal(b"grpc-accept-encoding", ACCEPTED.encode())
    return block


def headers_frame(stream_id: int, block: bytes, end: bool) -> bytes:
    return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream_id, block)


def message(payload: bytes | memoryview) -> bytes:
    """One gRPC length-prefixed message (not compressed)."""
    return struct.pack(">BI", 0, len(payload)) + bytes(payload)


def deadline(value: str) -> float | None:
    """A ``grpc-timeout`` value (1-8 ASCII digits and a unit) as a monotonic deadline;
    None when absent; ValueError when malformed."""
    if not value:
        return None
    digits, unit = value[:-1], value[-1:]
    ascii_digits = digits.isascii() and digits.isdigit()
    if unit not in _TIMEOUT_UNITS or not 1 <= len(digits) <= 8 or not ascii_digits:
        raise ValueError(f"malformed grpc-timeout {value[:32]!r}: 1 to 8 digits and H/M/S/m/u/n")
    return time.monotonic() + int(digits) * _TIMEOUT_UNITS[unit]


class TooLarge(ValueError):
    """A compressed message inflates past the limit."""


async def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """A compressed message, inflated to at most ``limit`` bytes: TooLarge past it,
    zlib.error when it is corrupt, truncated or followed by other bytes."""
    if encoding == "identity":
        raise zlib.error("the message is flagged compressed but grpc-encoding is identity")
    inflater = zlib.decompressobj(ENCODINGS[encoding])
    out = [inflater.decompress(data, min(limit + 1, OFFLOAD_BYTES))]
    if not inflater.eof and (inflater.unconsumed_tail or len(out[0]) == OFFLOAD_BYTES):
        await asyncio.to_thread(_rest, inflater, out, limit)
    size = sum(len(part) for part in out)
    if size > limit:
        raise TooLarge(f"Received message larger than max (more than {limit} bytes inflated)")
    if not inflater.eof:
        raise zlib.error("the compressed message is truncated")
    if inflater.unused_data:
        raise zlib.error("bytes after the end of the compressed message")
    return out[0] if len(out) == 1 else b"".join(out)


def _rest(inflater: zlib._Decompress, out: list[bytes], limit: int) -> None:
    """Inflate what is left (a worker thread: zlib runs without the GIL), stopping one
    byte past ``limit``."""
    size = sum(len(part) for part in out)
    while not inflater.eof and size <= limit:
        part = inflater.decompress(inflater.unconsumed_tail, limit + 1 - size)
        if not part and not inflater.unconsumed_tail:
            break  # the input ran out: truncated
        out.append(part)
        size += len(part)
