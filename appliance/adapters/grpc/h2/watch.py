"""The watchdog's decisions about one HTTP/2 connection, without I/O or clock of its
own (:class:`Watch`): the driver looks every :attr:`H2Limits.tick_s` and passes the
loop's time.

A connection is closed when the client's preface and SETTINGS, or its acknowledgement
of the server's (SETTINGS_TIMEOUT), did not come within ``read_timeout_s``; when a
frame or a header block begun that long ago is still unfinished (slowloris); and, with
GOAWAY NO_ERROR, when it has had no call for ``idle_timeout_s``. (A client that takes
nothing from a full write buffer is the driver's to see: the buffer is its.)
"""

from __future__ import annotations

from appliance.adapters.grpc.h2.frames import NO_ERROR, SETTINGS_TIMEOUT
from appliance.adapters.grpc.h2.limits import H2Limits


class Watch:
    """What the watchdog needs to know of a connection's life so far."""

    __slots__ = (
        "_limits",
        "_opened_seen",
        "_quiet_since",
        "acked",
        "born",
        "opened",
        "settled",
        "stalled",
    )

    def __init__(self, limits: H2Limits) -> None:
        self._limits = limits
        self.born = 0.0  # when the connection was made
        self.settled = False  # the client's SETTINGS followed its preface
        self.acked = False  # the client acknowledged the server's SETTINGS
        self.stalled = 0.0  # since when part of a frame waits for the rest (0: none)
        self.opened = 0  # streams opened: the idle watch sees calls
        self._opened_seen = 0
        self._quiet_since = 0.0  # since when the connection has had no call

    def start(self, now: float) -> None:
        self.born = self._quiet_since = now

    def read(self, partial: bool, frames: int, now: float) -> None:
        """A read ended with (``partial``) or without part of a frame left waiting;
        ``frames`` whole frames were in it."""
        if not partial:
            self.stalled = 0.0
        elif frames or not self.stalled:  # a new frame began in this read
            self.stalled = now

    def resumed(self, now: float) -> None:
        """Reading was paused (the client did not read its answers): a frame half
        received meanwhile was not the client's lateness."""
        if self.stalled:
            self.stalled = now

    def overdue(self, now: float, paused: bool, block_started: float | None) -> tuple[str, int]:
        """Why the connection must close now, and GOAWAY's code; ("", 0) when it need not.
        ``block_started``: when a header block under way began."""
        limit = self._limits.read_timeout_s
        late = now - self.born - limit >= 0
        if late and not self.settled:
            return "no HTTP/2 preface and SETTINGS within the read timeout", NO_ERROR
        if late and not self.acked:
            return "the server's SETTINGS were not acknowledged in time", SETTINGS_TIMEOUT
        if self.stalled and not paused and now - self.stalled >= limit:
            return "a frame was begun and not finished within the read timeout", NO_ERROR
        if block_started is not None and now - block_started >= limit:
            return "a header block was begun and not finished within the read timeout", NO_ERROR
        return "", NO_ERROR

    def idle(self, now: float, busy: bool) -> bool:
        """The connection has had no call for ``idle_timeout_s`` (``busy``: it has one now)."""
        if busy or self.opened != self._opened_seen:
            self._opened_seen = self.opened
            self._quiet_since = now
            return False
        return now - self._quiet_since >= self._limits.idle_timeout_s
