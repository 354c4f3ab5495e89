"""What one client may cost the gRPC endpoint: the HTTP/2 limits the server advertises
and enforces, its timeouts, and the budget of frames that make it work without
serving a call.

The first five fields of :class:`H2Limits` are operator settings (``grpc_*`` in the
server config, docs/security.md); the rest are fixed protocol choices. A
:class:`Budget` per connection is a token bucket: frames that cost the server work but
serve no call (PING, SETTINGS, PRIORITY, unknown frame types, empty DATA frames and
header fragments, streams the client resets or the server must refuse) each take a
token; tokens come back with time and with each call answered. A connection that runs
dry gets GOAWAY ENHANCE_YOUR_CALM: that is how ping, settings, empty-frame and Rapid
Reset (CVE-2023-44487) floods end, however fast the client sends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class H2Limits:
    # operator settings (appliance.yaml: grpc_max_connections, ...)
    max_connections: int = 256  # open connections, TLS handshakes included
    max_concurrent_streams: int = 100  # SETTINGS_MAX_CONCURRENT_STREAMS: calls at once
    max_header_list_size: int = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE
    idle_timeout_s: float = 300.0  # a connection without calls this long: GOAWAY, closed
    # the client's preface and its ACK of our SETTINGS, a frame or a header block once
    # begun, and a write the client stopped reading must each finish within this
    read_timeout_s: float = 30.0
    # what a client may send before the server hands window back: a stream
    # (SETTINGS_INITIAL_WINDOW_SIZE) and the whole connection; both sized from
    # max_request_size (for_message) and handed back only for bytes the server dropped
    # or keeps under an admitted hold (docs/security.md)
    stream_window: int = 16 * 2**20
    connection_window: int = 64 * 2**20 + 5
    # fixed choices
    max_continuations: int = 16  # frames one header block may span (HEADERS included)
    max_settings: int = 32  # entries in one SETTINGS frame
    write_buffer: int = 256 * 1024  # write-buffer high-water mark: past it, reading pauses
    flood_burst: int = 1000  # the budget's tokens (see Budget)
    flood_rate: float = 100.0  # tokens back per second
    flood_refund: int = 4  # tokens back per call answered

    def for_message(self, max_message: int) -> H2Limits:
        """These limits with the windows sized for messages of ``max_message`` bytes:
        the connection's one whole message (prefix included, at least HTTP/2's 65535),
        a stream's at most that and 16 MiB."""
        connection = max(65535, min(2**31 - 1, max_message + 5))
        stream = min(16 * 2**20, connection)
        return dataclasses.replace(self, stream_window=stream, connection_window=connection)

    @property
    def header_block_limit(self) -> int:
        """The most a header block may hold, compressed or decoded: twice the advertised
        list size. Between the two a request is answered RESOURCE_EXHAUSTED; past this
        the block is not decoded further and the connection ends (COMPRESSION_ERROR)."""
        return 2 * self.max_header_list_size

    @property
    def tick_s(self) -> float:
        """How often a connection's watchdog looks at its timeouts."""
        return max(0.01, min(self.read_timeout_s, self.idle_timeout_s) / 4)


class Budget:
    """A token bucket refilled lazily: :meth:`spend` reads the clock only when the
    tokens run out, so a well-behaved connection pays one subtraction per frame."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, burst: int, rate: float) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    def spend(self) -> bool:
        """Take a token; False when there is none even after the refill."""
        self._tokens -= 1.0
        if self._tokens >= 0.0:
            return True
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        return self._tokens >= 0.0

    def earn(self, tokens: int) -> None:
        self._tokens = min(self._burst, self._tokens + tokens)
