"""One connection's deadline on the event loop: what is late (a head, a body, the end
of lingering) and when, behind a single loop timer.

The HTTP front (:mod:`appliance.adapters.http.front`) re-arms its connection's deadline
at every request (the header timeout, then the body timeout, then the header timeout
again). Making and cancelling a loop timer each time cost more than the request's own
checks, so :class:`Deadline` keeps one timer and moves it only when the new deadline
comes earlier: a later re-arm is two attribute writes, and the timer, when it fires
early, re-schedules itself for the current deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_SLACK_S = 0.002  # a timer firing this close to its deadline counts as on time


class Deadline:
    """Call one callback when its deadline passes, unless re-armed or disarmed first."""

    __slots__ = ("_at", "_late", "_loop", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # when ``_late`` is due (loop time)
        self._late: Callable[[], None] | None = None  # what is called then

    def arm(self, delay: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` in ``delay`` seconds (replacing what was armed)."""
        self._at = at = self._loop.time() + delay
        self._late = callback
        timer = self._timer
        if timer is None or timer.when() > at:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(at, self._due)

    def disarm(self) -> None:
        """Nothing is late until the next :meth:`arm` (a pending timer then does
        nothing)."""
        self._late = None

    def stop(self) -> None:
        """Disarmed, and the loop's timer cancelled (the connection is done)."""
        self._late = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self._late is None:
            return  # disarmed meanwhile
        if self._loop.time() < self._at - _SLACK_S:  # re-armed later meanwhile
            self._timer = self._loop.call_at(self._at, self._due)
            return
        late, self._late = self._late, None
        late()
