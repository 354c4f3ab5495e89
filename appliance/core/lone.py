"""A cheap lone request on the event loop: run there at once, or held there for its
queue delay, instead of two thread hand-offs (docs/benchmarks.md, "Running a cheap
model inline").

The dynamic batcher asks :class:`LoneRequests` first when a request finds no other
in flight and its model is measured cheap (:class:`appliance.core.inline.InlineRunner`
runs it and keeps the measure). When the scheduler would send it at once it runs here
(:meth:`LoneRequests.run`). Else it would wait out the queue delay for others to join
(Triton's dynamic batcher), and it waits on the loop, not in the instances' queue:
held with the loop's microsecond timer (:mod:`appliance.core.loop_timer`), so no
thread wakes for it and no answer crosses back. An arrival meanwhile sends it to the
queue, with its arrival time, to batch there (:meth:`LoneRequests.to_queue`); when the
timer fires it runs here, or goes to the queue (sent at once) if no instance is idle.

Only the event loop's thread touches it. While a request is held the queue is empty
(any arrival sends the held one to the queue first), so the model's pending count is
1 while held and 0 after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from appliance.core.batch_queue import Pending, fail
from appliance.core.batching import BatchResult
from appliance.core.inline import InlineRunner
from appliance.core.loop_timer import LoopTimer
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError


class LoneRequests:
    """One batcher's cheap lone requests. ``claim(keep)``: an idle instance whose
    engine may run on the loop, with nothing queued (None: none), marked running when
    ``keep``; ``unclaim`` gives it back; ``arrive`` queues a request for the threads."""

    def __init__(
        self,
        runner: InlineRunner,
        model: str,
        batched: bool,
        delay_s: float,
        stats: ModelStats,
        claim: Callable[[bool], int | None],
        unclaim: Callable[[int], None],
        arrive: Callable[[Pending], None],
    ) -> None:
        self.runner = runner
        self.held: Pending | None = None  # the one request held for its delay
        self._model, self._batched, self._delay_s, self._stats = model, batched, delay_s, stats
        self._claim, self._unclaim, self._arrive = claim, unclaim, arrive
        # made at the first hold (False: the system has no timerfd, nothing is held)
        self._timer: LoopTimer | bool | None = None

    def run(
        self, inputs: dict[str, np.ndarray], outputs: tuple[str, ...], rows: int
    ) -> BatchResult | None:
        """Run a request on an idle instance's engine here, on the loop; None when
        something is queued or no such instance is idle (it goes to the queue)."""
        if (index := self._claim(True)) is None:
            return None
        result = self.runner.run(
            self._model, index, inputs, outputs, rows, self._batched, lambda: self._unclaim(index)
        )
        self._stats.record_execution(rows, result.input_ns, result.infer_ns, result.output_ns)
        return result

    def can_hold(self) -> bool:
        """Whether a request that waits out the queue delay may wait here: an
        instance is idle to run it then, and the loop's timer is there."""
        if self._claim(False) is None:
            return False
        if self._timer is None:
            self._timer = LoopTimer.create(asyncio.get_running_loop(), self._due) or False
        return self._timer is not False

    def hold(self, item: Pending) -> None:
        """Hold ``item`` for the queue delay (after :meth:`can_hold` said yes)."""
        assert isinstance(self._timer, LoopTimer) and self.held is None
        self.held = item
        self._stats.pending = 1
        self._timer.arm(self._delay_s)

    def take(self) -> Pending | None:
        """The held request, no longer held (None: none was)."""
        item, self.held = self.held, None
        if item is not None:
            assert isinstance(self._timer, LoopTimer)
            self._timer.disarm()
            self._stats.pending = 0
        return item

    def to_queue(self) -> None:
        """The held request goes to the instances' queue (another request arrived, or
        the batcher is stopping): it waits there for the rest of its delay."""
        if (item := self.take()) is not None:
            self._arrive(item)

    def close(self) -> None:
        """Once the batcher stops (the held request went to the queue first)."""
        if isinstance(self._timer, LoopTimer):
            self._timer.close()

    def _due(self) -> None:
        """The delay is over and the request is still alone: run it here."""
        item = self.take()
        if item is None or item.future.done():
            return
        start_ns = time.perf_counter_ns()
        result: BatchResult | ApplianceError | None
        try:
            result = self.run(item.inputs, item.outputs, item.rows)
        except ApplianceError as exc:
            result = exc
        if result is None:
            self._arrive(item)
            return
        if isinstance(result, ApplianceError):
            fail(item, result)
            return
        if item.timer is not None:
            item.timer.cancel()
        result.queue_ns = start_ns - item.enqueued_ns
        item.future.set_result(result)
