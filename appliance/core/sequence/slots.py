"""Which sequence holds which slot on which instance: placement, backlog, idle release.

The sequence batcher's bookkeeping, on the event loop only. Each instance is a
:class:`Lane` with a fixed number of slots; an open :class:`Sequence` (by
correlation id) holds one slot from its START until it has closed (END queued,
or idle too long) and nothing of it is queued or running; sequences that found no
free slot wait in the backlog and take freed slots oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from appliance.core.batching import BatchResult
from appliance.core.instances import ModelInstance
from appliance.request import InferenceRequest

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Queued:
    """One request of a sequence waiting for its turn (also what ``decide`` reads)."""

    request: InferenceRequest
    outputs: tuple[str, ...]
    signature: Hashable
    sequence: Sequence
    arrival: float  # time.monotonic()
    future: asyncio.Future[BatchResult] = field(repr=False)
    enqueued_ns: int = 0
    rows: int = 1


@dataclass(slots=True, eq=False)
class Sequence:
    """One correlation id's run; ``closing`` once END was queued or it idled out."""

    key: int | str
    queue: deque[Queued] = field(default_factory=deque)
    lane: Lane | None = None
    slot: int = -1
    state: dict[str, np.ndarray] | None = None  # None: not started on the model yet
    last_seen: float = 0.0
    closing: bool = False
    running: bool = False


@dataclass(slots=True, eq=False)
class Lane:
    """One instance and its sequence slots; ``busy`` while a batch runs on it."""

    instance: ModelInstance
    slots: list[Sequence | None]
    busy: bool = False


class SlotTable:
    """The lanes of one model version and the sequences open on them."""

    def __init__(
        self, model: str, instances: list[ModelInstance], slots: int, idle_s: float
    ) -> None:
        self.model = model
        self.lanes = [Lane(i, [None] * slots) for i in instances]
        self._idle_s = idle_s
        self._open: dict[int | str, Sequence] = {}  # correlation id -> open sequence
        self._backlog: deque[Sequence] = deque()
        self._next_reap = math.inf  # no sequence idles out before this (monotonic)

    @property
    def active(self) -> int:
        """Sequences holding a slot or waiting in the backlog."""
        return sum(s is not None for lane in self.lanes for s in lane.slots) + len(self._backlog)

    def get(self, key: int | str) -> Sequence | None:
        return self._open.get(key)

    def all(self) -> Iterator[Sequence]:
        """Every sequence that may still have queued requests."""
        seen = {*self._open.values(), *self._backlog}
        seen.update(s for lane in self.lanes for s in lane.slots if s is not None)
        return iter(seen)

    def open(self, key: int | str) -> Sequence:
        """A new sequence: the lane with the most free slots, else the backlog."""
        seq = self._open[key] = Sequence(key)
        best: Lane | None = None
        for lane in self.lanes:
            free = lane.slots.count(None)
            if free and (best is None or free > best.slots.count(None)):
                best = lane
        if best is None:
            self._backlog.append(seq)
        else:
            seq.lane, seq.slot = best, best.slots.index(None)
            best.slots[seq.slot] = seq
        return seq

    def touch(self, seq: Sequence, now: float) -> None:
        """A request arrived for ``seq``: its idle time starts again."""
        seq.last_seen = now
        self._next_reap = min(self._next_reap, now + self._idle_s)

    def close(self, seq: Sequence) -> None:
        """No more requests for ``seq`` (its END was queued, or it idled out); a later
        START with its id opens a new sequence."""
        seq.closing = True
        if self._open.get(seq.key) is seq:
            del self._open[seq.key]

    def release_if_done(self, seq: Sequence) -> bool:
        """Free the slot of a closing sequence once nothing of it is queued or running
        and hand it to the oldest backlogged sequence; True if one got it."""
        if not seq.closing or seq.queue or seq.running:
            return False
        if seq.lane is None:
            with contextlib.suppress(ValueError):
                self._backlog.remove(seq)
            return False
        lane, slot = seq.lane, seq.slot
        lane.slots[slot] = None
        seq.lane, seq.state = None, None
        if not self._backlog:
            return False
        nxt = self._backlog.popleft()
        nxt.lane, nxt.slot = lane, slot
        lane.slots[slot] = nxt
        # its idle time counts from when it can run, not from its wait in the backlog
        self.touch(nxt, time.monotonic())
        return True

    def reap(self, now: float) -> float:
        """Close sequences idle longer than max_sequence_idle; return when to look
        again. A closed sequence's queued requests still run; later ones need START.
        Requests only push idle deadlines later, so until the earliest one found last
        time nothing can be due."""
        if now < self._next_reap:
            return self._next_reap
        self._next_reap = next_check = math.inf  # slots handed on below lower it again
        for key, seq in list(self._open.items()):
            if seq.lane is None:
                continue  # backlogged: its idle time counts once it has a slot
            idle_until = seq.last_seen + self._idle_s
            if idle_until <= now:
                log.info("model '%s': sequence %s idled out; its slot is released", self.model, key)
                self.close(seq)
                self.release_if_done(seq)
            else:
                next_check = min(next_check, idle_until)
        self._next_reap = min(self._next_reap, next_check)
        return self._next_reap
