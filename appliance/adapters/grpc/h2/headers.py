"""Header blocks from gRPC clients: HPACK decoding (RFC 7541, by ``hpack``) within the
server's limits, and the request rules of RFC 9113 8.2-8.3.

Decoding keeps one dynamic table per connection, of at most 4096 bytes (the default;
the server never raises it: a larger size update is COMPRESSION_ERROR, as are bad
Huffman strings, indexes past the table and integers too long to be one). A block is
decoded to at most :attr:`H2Limits.header_block_limit` bytes, counted as
SETTINGS_MAX_HEADER_LIST_SIZE counts them, so a block of references to one big table
entry (a decode bomb) stops there; the connection then cannot go on
(COMPRESSION_ERROR). Within that bound, a list over the advertised size is a request
the call answers RESOURCE_EXHAUSTED.

A request that breaks the HTTP/2 field rules (pseudo-headers missing, repeated,
unknown or after the regular fields; upper-case or odd bytes in a name; NUL, CR or LF
in a value, or white space around it; connection-specific fields; ``te`` other than
``trailers``) is *malformed*: a stream error PROTOCOL_ERROR. Blocks made of indexed
fields only (what a client sends for the second and every later call on a connection)
come from a cache, already checked.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import hpack

from appliance.adapters.grpc.h2.frames import COMPRESSION_ERROR, ProtocolError

_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))
_REQUIRED = (b":method", b":scheme", b":path")
_CONNECTION = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)
# a field name: no 0x00-0x20, upper case, 0x7f-0xff or ':' (RFC 9113 8.2.1)
_BAD_NAME = re.compile(rb"[^\x21-\x39\x3b-\x40\x5b-\x7e]")
_BAD_VALUE = re.compile(rb"[\x00\n\r]|\A[ \t]|[ \t]\Z")


class Block(NamedTuple):
    headers: list[tuple[str, str]]  # names ASCII; values UTF-8 (other bytes kept as escapes)
    size: int  # name + value + 32 per field, as SETTINGS_MAX_HEADER_LIST_SIZE counts
    malformed: str  # why the fields break RFC 9113 8.2-8.3; "" when they do not


def check(fields: list[tuple[bytes, bytes]], trailers: bool) -> Block:
    """The decoded fields of a request's header block (or its trailers) as a Block."""
    headers: list[tuple[str, str]] = []
    size = 0
    problem = ""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        size += len(name) + len(value) + 32
        if problem:
            continue
        if name[:1] == b":":
            if trailers:
                problem = f"a pseudo-header {name!r} in trailers"
            elif regular:
                problem = f"the pseudo-header {name!r} after a regular field"
            elif name not in _PSEUDO:
                problem = f"an unknown pseudo-header {name!r}"
            elif name in seen:
                problem = f"the pseudo-header {name!r} twice"
            elif name == b":path" and not value:
                problem = "an empty :path"
            seen.add(name)
        else:
            regular = True
            if not name or _BAD_NAME.search(name):
                problem = f"a field name that is not lower-case visible ASCII: {name[:64]!r}"
            elif name in _CONNECTION:
                problem = f"the connection-specific field {name!r}"
            elif name == b"te" and value != b"trailers":
                problem = f"te: {value[:64]!r} (only 'trailers' is allowed)"
        if not problem and _BAD_VALUE.search(value):
            problem = f"the value of {name[:64]!r} holds NUL, CR, LF or surrounding white space"
        headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
    if not trailers and not problem:
        missing = [n.decode() for n in _REQUIRED if n not in seen]
        if missing:
            problem = f"no {', '.join(missing)}"
    return Block(headers, size, problem)


class HeaderDecoder:
    """One connection's header-block decoder (its hpack dynamic table and cache)."""

    def __init__(self, most: int) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = most
        self._indexed: dict[bytes, Block] = {}

    def decode(self, block: bytes, trailers: bool = False) -> Block:
        """A header block -> its Block; COMPRESSION_ERROR when hpack refuses it."""
        hit = self._indexed.get(block)
        if hit is not None and not trailers:
            return hit
        try:
            fields = self._decoder.decode(block, raw=True)
        except Exception as exc:  # hpack's errors: the connection cannot go on
            raise ProtocolError(COMPRESSION_ERROR, f"a header block hpack refused: {exc}") from None
        decoded = check([(bytes(k), bytes(v)) for k, v in fields], trailers)
        if all(b & 0x80 and b != 0xFF for b in block):
            if not trailers:
                if len(self._indexed) > 64:
                    self._indexed.clear()
                self._indexed[block] = decoded
        else:  # the block may have changed the dynamic table: indexes mean other things now
            self._indexed.clear()
        return decoded


class PendingBlock:
    """A header block being received in HEADERS + CONTINUATION frames."""

    __slots__ = ("block", "flags", "frames", "looped", "sid", "started")

    def __init__(self, sid: int, flags: int, block: memoryview, looped: bool, now: float):
        self.sid, self.flags, self.block, self.looped = sid, flags, bytearray(block), looped
        self.frames, self.started = 1, now
