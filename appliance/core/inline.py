"""A cheap lone request run on the event loop, in place of two thread hand-offs.

The instances whose engine may be called from the loop's thread
(``Backend.inline_safe``: ONNX Runtime on the CPU) and what their one-request runs
cost (:class:`appliance.core.batching.InlineCost`). The dynamic batcher decides when
a request qualifies (nothing queued, no other request in flight, the model measured
cheap), :mod:`appliance.core.lone` runs it at once or after holding it for its queue
delay on an instance the batcher claimed under its lock, and this runs it and
measures it (docs/benchmarks.md, "Running a cheap model inline").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence

import numpy as np

from appliance.backends.base import Backend
from appliance.core.batching import INLINE_BOUND_NS, BatchResult, InlineCost, run_alone


class InlineRunner:
    def __init__(self, backends: Sequence[Backend]) -> None:
        # per instance index: its engine when it may run on the loop, else None
        self.backends: list[Backend | None] = [
            b if getattr(b, "inline_safe", False) else None for b in backends
        ]
        self.cost = InlineCost()

    @classmethod
    def of(cls, backends: Sequence[Backend]) -> InlineRunner | None:
        """The runner of these instances' engines; None when none may run on the loop."""
        runner = cls(backends)
        return runner if any(b is not None for b in runner.backends) else None

    def idle(self, running: Container[int], undelivered: Container[int]) -> int | None:
        """An instance that may run on the loop and is neither running nor holding
        answers the loop has not taken (under the batcher's lock)."""
        for index, backend in enumerate(self.backends):
            if backend is not None and index not in running and index not in undelivered:
                return index
        return None

    def run(
        self,
        model: str,
        index: int,
        inputs: dict[str, np.ndarray],
        outputs: tuple[str, ...],
        rows: int,
        batched: bool,
        done: Callable[[], None],
    ) -> BatchResult:
        """Run one request on claimed instance ``index`` here, on the event loop;
        ``done`` gives the claim back. A run over four times the bound counts by the
        CPU the loop's thread spent on it when that is under the bound (the thread was
        preempted, the model is not slow)."""
        backend = self.backends[index]
        assert backend is not None  # (claimed: inline-safe)
        start_ns, cpu0_ns = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return run_alone(model, backend, inputs, outputs, rows, batched)
        finally:
            done()
            wall_ns = time.perf_counter_ns() - start_ns
            cpu_ns = None
            if wall_ns > 4 * INLINE_BOUND_NS:  # slow, or the thread lost the CPU?
                cpu_ns = time.thread_time_ns() - cpu0_ns
            self.cost.record(wall_ns, inline=True, cpu_ns=cpu_ns)
