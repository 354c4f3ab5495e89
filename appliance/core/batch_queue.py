"""The dynamic batcher's queue: priority levels, each with its queue policy (Triton's
``PriorityQueue`` of ``PolicyQueue``).

One deque holds every queued request in the order batches are taken from it: by
priority level (1 first), within a level the requests that have not timed out in
arrival order, then those whose timeout passed under ``timeout_action: DELAY`` in the
order they timed out. :func:`appliance.core.batching.decide` reads it front to back,
as before priorities. Each level's policy (``priority_queue_policy``, else
``default_queue_policy``) bounds how many of its requests may wait
(``max_queue_size``; 0: the server's ``default_max_queue_size``, so no level is
unbounded), and gives the timeout a request gets (:meth:`Levels.timeout_s`) and what
happens when it passes (:meth:`Levels.delays`).

Time is not read here: the batcher arms one loop timer per request that has a timeout
and, when it fires, withdraws it (REJECT) or calls :meth:`BatchQueue.delay` (DELAY).
Every operation is bounded by the requests it passes over (a new arrival goes behind
its level: it passes only the less urgent and the delayed ones behind it).

Not thread-safe: the batcher's lock guards every call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from appliance.config.model_config import DynamicBatching
from appliance.config.scheduling_config import QueuePolicy
from appliance.core.batching import BatchResult
from appliance.errors import ApplianceError, FailureReason, unavailable


@dataclass(slots=True, eq=False)
class Pending:
    """One queued request."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int
    signature: Hashable
    arrival: float  # time.monotonic()
    future: asyncio.Future[BatchResult] = field(repr=False)
    enqueued_ns: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    level: int = 0  # priority level: the queue is ordered by it, then by arrival
    delayed: bool = False  # timed out under DELAY: behind its level's other requests

    def key(self) -> tuple[int, bool]:
        return (self.level, self.delayed)


class Levels:
    """Each priority level's queue policy, and the rules they give."""

    def __init__(self, db: DynamicBatching | None, server_max_queue_size: int) -> None:
        self.default = db.default_queue_policy if db is not None else QueuePolicy()
        self.by_level = dict(db.priority_queue_policy) if db is not None else {}
        self._server_max = server_max_queue_size
        # read per request: each level's bound, and whether any level has a timeout
        self.default_bound = self.default.max_queue_size or server_max_queue_size
        self.bounds = {
            level: p.max_queue_size or server_max_queue_size for level, p in self.by_level.items()
        }
        self._timeouts = any(p.default_timeout_us for p in (self.default, *self.by_level.values()))

    def policy(self, level: int) -> QueuePolicy:
        return self.by_level.get(level, self.default)

    def bound(self, level: int) -> int:
        """How many requests of ``level`` may wait."""
        return self.bounds.get(level, self.default_bound)

    def timeout_s(self, level: int, requested_us: int | None) -> float | None:
        """The queue timeout of a request of ``level`` that asked for ``requested_us``
        (its ``timeout`` parameter): the policy's default, or the request's own where
        the policy allows an override and it is shorter (Triton's rule; with no default
        timeout the request's own applies, where Triton ignores it)."""
        if not requested_us and not self._timeouts:
            return None  # (the common case, at once)
        policy = self.policy(level)
        timeout_us = policy.default_timeout_us
        if (
            requested_us
            and policy.allow_timeout_override
            and (not timeout_us or requested_us < timeout_us)
        ):
            timeout_us = requested_us
        return timeout_us / 1e6 if timeout_us else None

    def delays(self, level: int) -> bool:
        """Whether a request of ``level`` that timed out stays queued (DELAY)."""
        return self.policy(level).timeout_action == "DELAY"


def queue_full(request_id: str = "") -> ApplianceError:
    """Triton's refusal of a request whose level's queue is full."""
    prefix = f"[request id: {request_id}] " if request_id else ""
    return unavailable(f"{prefix}Exceeds maximum queue size", FailureReason.REJECTED)


def timed_out() -> ApplianceError:
    """Triton's answer to a request whose queue timeout passed under REJECT."""
    return unavailable("Request timeout expired", FailureReason.REJECTED)


def unloaded(model: str, when: str) -> ApplianceError:
    """The answer to a request its model was unloaded ``when`` ("before", "while") it
    ran, once the unload's drain gave up."""
    text = f"model '{model}' was unloaded {when} the request ran"
    return unavailable(text, FailureReason.REJECTED)


def fail(item: Pending, error: ApplianceError) -> None:
    """Answer ``item`` with ``error`` (its queue timeout cancelled), unless its caller
    went away."""
    if item.timer is not None:
        item.timer.cancel()
    if not item.future.done():
        item.future.set_exception(error)


class BatchQueue:
    """The queued requests in batch order, with each level's count and the rows."""

    __slots__ = ("_bounds", "_counts", "_default_bound", "items", "rows")

    def __init__(self, levels: Levels) -> None:
        self.items: deque[Pending] = deque()
        self.rows = 0  # the rows of every queued request
        self._counts: dict[int, int] = {}
        self._bounds, self._default_bound = levels.bounds, levels.default_bound

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self.items)

    def __getitem__(self, index: int) -> Pending:
        return self.items[index]

    def count(self, level: int) -> int:
        return self._counts.get(level, 0)

    def full(self, level: int) -> bool:
        """Whether ``level`` holds as many requests as its queue policy lets wait."""
        return self._counts.get(level, 0) >= self._bounds.get(level, self._default_bound)

    def arrive(self, item: Pending, wake_rows: int) -> bool:
        """Queue ``item`` (:meth:`push`); whether the arrival can change the decision
        of an instance waiting out the queue delay, which is then woken: into an empty
        queue, ahead of another request, the rows reaching ``wake_rows``
        (:func:`appliance.core.batching.wake_rows`), or another shape than the head's
        (which ends the batch). Not every arrival: one wake-up per batch."""
        was_empty = not self.items
        ahead = self.push(item)
        head = self.items[0]
        return was_empty or ahead or self.rows >= wake_rows or item.signature != head.signature

    def push(self, item: Pending) -> bool:
        """Queue ``item`` behind its level's requests that have not timed out (and
        every more urgent one); True when it went ahead of another request."""
        items = self.items
        last = items[-1] if items else None
        if (
            last is None
            or last.level < item.level
            or (last.level == item.level and (item.delayed or not last.delayed))
        ):
            items.append(item)
            ahead = False
        else:
            at = len(items) - 1
            while at and items[at - 1].key() > item.key():
                at -= 1
            items.insert(at, item)
            ahead = True
        self._counted(item, 1)
        return ahead

    def remove(self, item: Pending) -> bool:
        """Take ``item`` out; False when it is no longer queued (an instance took it)."""
        try:
            self.items.remove(item)
        except ValueError:
            return False
        self._counted(item, -1)
        return True

    def delay(self, item: Pending) -> bool:
        """``item`` timed out under DELAY: it goes behind every request of its level
        (the delayed ones before it included). False when it is no longer queued.
        Whether it was the head (a new head may change the batching decision) is
        the caller's to check before."""
        if item.delayed or not self.remove(item):
            return False
        item.delayed = True
        self.push(item)
        return True

    def pop(self, positions: tuple[int, ...]) -> list[Pending]:
        """Take the requests at ``positions`` (ascending) for a batch."""
        if positions == (0,):
            taken = [self.items.popleft()]
        else:
            chosen = set(positions)
            taken = [self.items[i] for i in positions]
            # a new deque: the old one's blocks go back after a burst
            self.items = deque(x for i, x in enumerate(self.items) if i not in chosen)
        counts = self._counts
        for item in taken:
            self.rows -= item.rows
            left = counts[item.level] - 1
            if left:
                counts[item.level] = left
            else:
                del counts[item.level]
        return taken

    def clear(self) -> list[Pending]:
        taken, self.items = list(self.items), deque()
        self.rows = 0
        self._counts.clear()
        return taken

    def _counted(self, item: Pending, sign: int) -> None:
        self.rows += sign * item.rows
        left = self._counts.get(item.level, 0) + sign
        if left:
            self._counts[item.level] = left
        else:
            self._counts.pop(item.level, None)
