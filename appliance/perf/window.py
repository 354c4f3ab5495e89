"""The measured window of one ``appliance perf`` point: what counts, when it opens and closes.

A window opens once the server's statistics at its start have been read (the load is
already running: that was the warm-up) and lasts ``--duration`` seconds; a request
counts if it completes inside it. The server's statistics are read again after it
closes, so their difference covers every request sent inside the window.

With a minimum count (``--measurement-request-count N``, perf_analyzer's count
windows) the window also stays open until N requests *sent* inside it have completed
or failed, however long that takes on a loaded machine, up to
:data:`COUNT_WINDOW_MAX_S` past its nominal end; a server that answers nothing in that
time leaves the point with what it has (nothing: perf exits 1). Counting only
requests sent inside the window means each success counted is in the server's figures
too.

A worker process of ``--processes N`` learns from its parent when the window opened,
after the fact: completions from the planned opening on are held until then.
"""

from __future__ import annotations

import math
import time

# how long past its nominal end a counting window may wait for its requests
COUNT_WINDOW_MAX_S = 60.0


class Window:
    """Latencies of requests completing inside [start, until]; errors by kind.

    ``end`` is the nominal end (``start`` + the duration); ``until`` the instant up to
    which completions count: ``end`` for a time window, later while a counting window
    still lacks requests, and the moment its last one completed once it has them.
    """

    def __init__(self, start: float, end: float, min_fresh: int = 0) -> None:
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.min_fresh = min_fresh
        self.fresh = 0  # completed requests that were sent inside the window
        self.opens_at = start
        self.length = end - start
        self._held: list[tuple[str, float, float]] | None = None
        self._span(start, end)

    @classmethod
    def opening(cls, opens_at: float, length: float, min_fresh: int = 0) -> Window:
        """A window that opens when :meth:`open` is called (not before ``opens_at``)."""
        window = cls(math.inf, math.inf, min_fresh)
        window.opens_at, window.length, window._held = opens_at, length, []
        return window

    def _span(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.until = end + COUNT_WINDOW_MAX_S if self.min_fresh else end

    def open(self, at: float) -> None:
        """Open the window at ``at`` (a ``time.perf_counter`` instant, maybe past)."""
        held, self._held = self._held or [], None
        self._span(at, at + self.length)
        for kind, began, now in held:
            if kind:
                self.failed(kind, now, began)
            else:
                self.done(began, now)

    def done(self, began: float, now: float) -> None:
        """A request sent at ``began`` completed at ``now``."""
        if self._held is not None:
            if now >= self.opens_at:
                self._held.append(("", began, now))
        elif self.start <= now <= self.until:
            self.latencies.append(now - began)
            self._count(began, now)

    def failed(self, kind: str, now: float, began: float | None = None) -> None:
        """A request sent at ``began`` (not sent: None) failed at ``now``."""
        began = now if began is None else began
        if self._held is not None:
            if now >= self.opens_at:
                self._held.append((kind, began, now))
        elif self.start <= now <= self.until:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self._count(began, now)

    def _count(self, began: float, now: float) -> None:
        if began >= self.start:  # sent inside the window: it counts towards min_fresh
            self.fresh += 1
            if self.fresh == self.min_fresh:  # enough: close at the nominal end, or now
                self.until = max(self.end, now)

    @property
    def seconds(self) -> float:
        """How long the window was open (once closed)."""
        return self.until - self.start


def make_window(
    warmup_s: float, window_s: float, start_at: float | None = None, min_fresh: int = 0
) -> Window:
    """A window that opens after ``warmup_s`` from now, or at ``start_at`` (a
    ``time.time()`` instant: worker processes share one window that way), at the
    earliest."""
    now = time.perf_counter()
    opens_at = now + warmup_s if start_at is None else local_instant(start_at)
    return Window.opening(opens_at, window_s, min_fresh)


def local_instant(wall: float) -> float:
    """A ``time.time()`` instant as ``time.perf_counter`` reads it in this process."""
    return time.perf_counter() + (wall - time.time())
