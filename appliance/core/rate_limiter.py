"""The rate limiter (Triton's ``--rate-limit=execution_count``): an instance runs a
batch only once it holds the resources its instance group's ``rate_limiter`` names.

One limiter serves the whole server (``rate_limit: execution_count`` in the server
config); without it (the default) the batchers never call it, so it costs nothing.

Rules, as Triton's ``RateLimiter``:

- A resource is per device (the instance's; the appliance runs every instance on
  device 0) unless the group marks it ``global``, then one pool serves every model
  and device: e.g. one NPU or a DSP that one model at a time may use. A name may not
  be both global and per device.
- How many of a resource exist: the server's ``rate_limit_resources`` when it names
  any (a global resource takes the largest count given for its name; a per-device
  one the count for its device, else the count given for every device; a resource
  not named has none), else the most that any one loaded instance needs. A model
  whose instance needs more than exists fails to load, with Triton's error text.
- An instance with a batch to send asks (:meth:`RateLimiter.acquire`); the askers
  wait in order of ``executions x priority`` (the group's ``priority`` is a weight: 2
  gets half the turns of 1; 0 counts as 1), then of asking. Only the first in that
  order may take resources (a big request is not starved by smaller ones), and it
  takes them as soon as they are free: on asking, or when another instance gives
  them back (:meth:`RateLimiter.release`, :meth:`RateLimiter.withdraw`).

Threads: instance threads call in while holding their batcher's lock, so the
limiter never takes a batcher's lock itself. An operation that grants resources to
other waiting instances returns their tickets; the caller calls :meth:`Ticket.wake`
on each once it holds no batcher lock (:func:`wake`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence

from appliance.config.scheduling_config import RateLimiterConfig, ResourceTotal
from appliance.errors import ApplianceError, Code

# a pool: (device, name); device None for a global resource
Key = tuple[int | None, str]
DEVICE = 0  # the device every instance runs on


class Ticket:
    """One instance's standing with the limiter. ``wanting`` is set and cleared by the
    instance's own thread only (it asked and has not given back), so that thread may
    read it without the limiter's lock."""

    __slots__ = (
        "dead",
        "executions",
        "granted",
        "name",
        "needs",
        "priority",
        "seq",
        "staged",
        "wake",
        "wanting",
    )

    def __init__(
        self, name: str, needs: dict[Key, int], priority: int, wake: Callable[[], None]
    ) -> None:
        self.name = name
        self.needs = needs
        self.priority = max(priority, 1)
        self.wake = wake  # tells the instance's batcher to look again (takes its lock)
        self.executions = 0
        self.seq = 0  # when it last asked: ties go to the earlier
        self.staged = False  # waiting in line
        self.granted = False  # holds its resources (until released)
        self.wanting = False
        self.dead = False  # its model was unloaded while it ran


def wake(tickets: Iterable[Ticket]) -> None:
    """Tell each instance it was granted its resources (hold no batcher lock)."""
    for ticket in tickets:
        ticket.wake()


def take_turn(
    limiter: RateLimiter, ticket: Ticket, send: bool, lock: threading.Condition
) -> bool | None:
    """An instance thread's step with the limiter, holding its batcher's ``lock``:
    asks for its resources when it has a batch to ``send`` (True: it holds them and
    may send), else gives back its place or grant (False). None: other instances were
    granted theirs, so the lock was let go meanwhile to wake them (look at the queue
    again)."""
    if send:
        granted, others = limiter.acquire(ticket)
    else:
        granted, others = False, limiter.withdraw(ticket)
    if not others:
        return granted
    lock.release()
    try:
        wake(others)
    finally:
        lock.acquire()
    return None


def needs_of(config: RateLimiterConfig | None, device: int = DEVICE) -> dict[Key, int]:
    if config is None:
        return {}
    return {(None if r.is_global else device, r.name): r.count for r in config.resources if r.count}


class RateLimiter:
    def __init__(self, totals: Sequence[ResourceTotal] = ()) -> None:
        self._explicit = tuple(totals)
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        self._available: dict[Key, int] = {}
        self._allocated: dict[Key, int] = {}
        self._staged: list[tuple[int, int, Ticket]] = []  # a heap
        self._seq = itertools.count()

    # ---- models coming and going ----------------------------------------------------------

    def register(
        self,
        model: str,
        configs: Sequence[RateLimiterConfig | None],
        count: int,
        wake_model: Callable[[], None],
    ) -> list[Ticket]:
        """Tickets for a model's ``count`` instances (``configs``: each one's group's
        ``rate_limiter``; None or left out: it needs nothing), or INVALID_ARG naming
        what cannot be scheduled; nothing is registered then."""
        tickets = []
        for i in range(count):
            c = configs[i] if i < len(configs) else None
            tickets.append(Ticket(f"{model}_{i}", needs_of(c), c.priority if c else 1, wake_model))
        with self._lock:
            everyone = [*self._tickets, *tickets]
            available = self._totals(everyone)
            self._check(everyone, available)
            self._tickets.update(tickets)
            self._available = available
        return tickets

    def unregister(self, tickets: Iterable[Ticket]) -> list[Ticket]:
        """A model's instances leave (it stopped); a ticket still running keeps its
        resources until :meth:`release`. Returns the tickets this grants."""
        with self._lock:
            for t in tickets:
                t.dead = True
                t.staged = False
                if not t.granted:
                    self._tickets.discard(t)
            self._staged = [s for s in self._staged if not s[2].dead]
            heapq.heapify(self._staged)
            self._available = self._totals(self._tickets)
            return self._allocate()

    def _totals(self, tickets: Iterable[Ticket]) -> dict[Key, int]:
        most: dict[Key, int] = {}
        for t in tickets:
            for key, count in t.needs.items():
                most[key] = max(most.get(key, 0), count)
        if not self._explicit:
            return most
        out: dict[Key, int] = {}
        for device, name in most:
            counts = [
                e.count
                for e in self._explicit
                if e.name == name and (device is None or e.device in (device, None))
            ]
            out[(device, name)] = max(counts, default=0)
        return out

    @staticmethod
    def _check(tickets: list[Ticket], available: dict[Key, int]) -> None:
        global_names = {name for device, name in available if device is None}
        for device, name in available:
            if device is not None and name in global_names:
                raise ApplianceError(
                    Code.INVALID_ARG,
                    f'Resource "{name}" is present as both global and device-specific '
                    "resource in the model configuration.",
                )
        for t in tickets:
            for key, count in t.needs.items():
                if count > available.get(key, 0):
                    raise ApplianceError(
                        Code.INVALID_ARG,
                        f'Resource count for "{key[1]}" is limited to {available.get(key, 0)} '
                        "which will prevent scheduling of one or more model instances, "
                        f"the minimum required count is {count}",
                    )

    # ---- an instance's turn ------------------------------------------------------------

    def acquire(self, ticket: Ticket) -> tuple[bool, list[Ticket]]:
        """The instance has a batch to send: whether it holds its resources now (if
        not it waits in line and its batcher is woken when granted), and the other
        tickets this granted."""
        with self._lock:
            if ticket.granted:
                return True, []
            if ticket.dead:  # its model stopped: it takes nothing more
                return False, []
            ticket.wanting = True
            if not ticket.staged:
                ticket.staged = True
                ticket.seq = next(self._seq)
                heapq.heappush(
                    self._staged, (ticket.executions * ticket.priority, ticket.seq, ticket)
                )
            granted = self._allocate()
        if ticket in granted:
            granted.remove(ticket)
            return True, granted
        return False, granted

    def withdraw(self, ticket: Ticket) -> list[Ticket]:
        """The instance no longer has a batch to send: it leaves the line, or gives
        back what it was granted unused. Returns the tickets this grants."""
        with self._lock:
            ticket.wanting = False
            if ticket.staged:
                ticket.staged = False
                self._staged = [s for s in self._staged if s[2] is not ticket]
                heapq.heapify(self._staged)
            if ticket.granted:
                ticket.executions -= 1  # not run after all: its turn is not counted
                self._free(ticket)
            return self._allocate()

    def release(self, ticket: Ticket) -> list[Ticket]:
        """The instance ran its batch: its resources go back. Returns the tickets this
        grants."""
        with self._lock:
            ticket.wanting = False
            if ticket.granted:
                self._free(ticket)
            return self._allocate()

    def _free(self, ticket: Ticket) -> None:
        ticket.granted = False
        for key, count in ticket.needs.items():
            self._allocated[key] -= count
        if ticket.dead:
            self._tickets.discard(ticket)
            self._available = self._totals(self._tickets)

    def _allocate(self) -> list[Ticket]:
        """Grant the first in line while its resources are free."""
        granted = []
        while self._staged:
            _, _, first = self._staged[0]
            available, allocated = self._available, self._allocated
            if any(allocated.get(k, 0) + n > available.get(k, 0) for k, n in first.needs.items()):
                break
            heapq.heappop(self._staged)
            for key, count in first.needs.items():
                allocated[key] = allocated.get(key, 0) + count
            first.staged = False
            first.granted = True
            first.executions += 1
            granted.append(first)
        return granted

    def in_use(self) -> dict[Key, int]:
        """What is allocated now (for tests and diagnostics)."""
        with self._lock:
            return {k: v for k, v in self._allocated.items() if v}


def from_settings(mode: str, totals: Sequence[ResourceTotal]) -> RateLimiter | None:
    """The server's limiter: None when ``rate_limit`` is off."""
    return RateLimiter(totals) if mode == "execution_count" else None
