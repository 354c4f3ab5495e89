"""Dynamic batching: one bounded queue per model version, one scheduler task.

The decision is the pure function :func:`decide` (queue view + monotonic now ->
send these requests now, or wait N seconds), as Triton's DynamicBatchScheduler
does; the scheduler task only waits and dispatches. Batches are formed from
decoded tensors (concatenated on axis 0 on the instance's thread, never on the
event loop) and results are split back by each request's row count as views.

Concurrency contract: each request's future is resolved by exactly one party,
the scheduler (timeout, stop) or the batch task (result, error), and always after
checking ``done()`` since the caller may have been cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from appliance.core.instances import InstanceGroup, ModelInstance
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, FailureReason, internal, unavailable
from appliance.request import InferenceRequest
from backends.base import Backend

log = logging.getLogger(__name__)


class Queued(Protocol):
    """What the decision looks at for each queued request."""

    @property
    def rows(self) -> int: ...
    @property
    def signature(self) -> Hashable: ...
    @property
    def arrival(self) -> float: ...


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How a model batches. ``max_batch_size == 0`` or ``dynamic=False``: one request per call."""

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    dynamic: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """``send``: queue positions to execute now (empty: nothing yet).
    ``wait_s``: when nothing is sent, how long until the decision may change
    without a new arrival (None: only a new arrival can change it)."""

    send: tuple[int, ...] = ()
    wait_s: float | None = None


def decide(queue: Iterable[Queued], now: float, policy: BatchPolicy) -> Decision:
    """Pick the next batch from ``queue`` (oldest first) at monotonic time ``now``.

    Triton's dynamic-batcher rules. The oldest request always leads; later requests
    join if their non-batch shapes match (same ``signature``) and their rows fit
    under max_batch_size; requests with other shapes are skipped, keep their place
    and are never merged. Then, in order:

    1. If the batch reached a preferred size (or can't reach the largest preferred
       size without passing it) and the oldest request's delay has not expired,
       send the largest such batch now.
    2. Send everything picked if the batch is full or can't grow (the next matching
       request doesn't fit), reached the largest preferred size, the delay expired,
       or there is no delay.
    3. Otherwise wait for the rest of the oldest request's max_queue_delay.
    """
    it = iter(queue)
    head = next(it, None)
    if head is None:
        return Decision()
    if not policy.dynamic or policy.max_batch_size <= 0:
        return Decision(send=(0,))
    limit = policy.max_batch_size
    preferred = set(policy.preferred_batch_sizes)
    largest_preferred = min(max(preferred), limit) if preferred else limit
    picked, rows, blocked = [0], head.rows, False
    best = 1 if rows in preferred else 0  # number of picked requests to send early
    for index, item in enumerate(it, start=1):
        if rows >= limit:
            break
        if item.signature != head.signature:
            continue
        if rows + item.rows > largest_preferred and not best:
            best = len(picked)  # growing further passes every preferred size
        if rows + item.rows > limit:
            blocked = True  # FIFO among compatible requests: later ones don't jump ahead
            break
        picked.append(index)
        rows += item.rows
        if rows in preferred:
            best = len(picked)
    delay = policy.max_queue_delay_s
    expired = delay <= 0 or now - head.arrival >= delay
    if best and not expired:
        return Decision(send=tuple(picked[:best]))
    if blocked or expired or rows >= largest_preferred:
        return Decision(send=tuple(picked))
    return Decision(wait_s=head.arrival + delay - now)


@dataclass(slots=True)
class BatchResult:
    """What one request gets back: its slice of the outputs and the batch timings."""

    outputs: dict[str, np.ndarray]
    queue_ns: int
    input_ns: int
    infer_ns: int
    output_ns: int


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int
    signature: Hashable
    arrival: float  # time.monotonic()
    deadline: float | None
    future: asyncio.Future[BatchResult] = field(repr=False)
    enqueued_ns: int = 0


def run_batch(
    backend: Backend,
    items: list[dict[str, np.ndarray]],
    rows: list[int],
    outputs: list[str],
    batched: bool,
) -> tuple[list[dict[str, np.ndarray]], int, int, int]:
    """Worker-thread side of one execution: gather inputs, infer, split outputs."""
    t0 = time.perf_counter_ns()
    if len(items) == 1:
        batch = items[0]  # the common unbatched case: zero copies
    else:
        batch = {name: np.concatenate([it[name] for it in items]) for name in items[0]}
    t1 = time.perf_counter_ns()
    result = backend.infer(batch, outputs)
    t2 = time.perf_counter_ns()
    missing = [name for name in outputs if name not in result]
    if missing:  # caught here, on the worker, it fails the batch instead of stranding futures
        raise internal(
            f"the backend did not return the requested output(s) {', '.join(map(repr, missing))}",
            FailureReason.BACKEND,
        )
    if len(items) == 1:
        parts = [result]
    else:
        total = sum(rows)
        for name, arr in result.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                raise internal(
                    f"output '{name}' has shape {list(arr.shape)} but the batch had {total} rows",
                    FailureReason.BACKEND,
                )
        parts, start = [], 0
        for n in rows:
            parts.append({name: arr[start : start + n] for name, arr in result.items()})
            start += n
    if batched:
        del batch  # release the gathered inputs before the results travel back
    t3 = time.perf_counter_ns()
    return parts, t1 - t0, t2 - t1, t3 - t2


class DynamicBatcher:
    """The queue and scheduler of one model version.

    ``submit`` enqueues or rejects at once (queue full -> UNAVAILABLE); the
    scheduler task forms batches whenever an instance is idle. ``stop`` stops
    accepting, lets queued and running work finish within the timeout, then fails
    what is left with UNAVAILABLE.
    """

    def __init__(
        self,
        model: str,
        instances: InstanceGroup,
        policy: BatchPolicy,
        max_queue_size: int,
        stats: ModelStats,
    ) -> None:
        self.model = model
        self.policy = policy
        self.max_queue_size = max_queue_size
        self._instances = instances
        self._stats = stats
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()  # hard refs so tasks aren't GC'd
        self._accepting = True
        self._next_deadline = float("inf")
        self._scheduler = asyncio.get_running_loop().create_task(
            self._schedule(), name=f"batcher:{model}"
        )
        self._scheduler.add_done_callback(self._scheduler_done)

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        """A scheduler that died of a bug must not strand its callers."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("model '%s': batch scheduler failed", self.model, exc_info=task.exception())
        self._accepting = False
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(internal(f"model '{self.model}' scheduler failed"))
        self._queue.clear()

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def submit(
        self,
        inputs: dict[str, np.ndarray],
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
    ) -> BatchResult:
        """Queue one request and wait for its share of a batch.

        Raises UNAVAILABLE (reason REJECTED) when the queue is full, the request
        timed out in the queue, or the model is stopping; cancelling the await
        removes the request from the queue if it has not started executing.
        """
        if not self._accepting:
            raise unavailable(f"model '{self.model}' is unloading", FailureReason.REJECTED)
        if len(self._queue) >= self.max_queue_size:
            raise unavailable(
                f"model '{self.model}' is overloaded: its queue is full "
                f"({self.max_queue_size} requests waiting)",
                FailureReason.REJECTED,
            )
        now = time.monotonic()
        deadline = now + timeout_s if timeout_s else None
        item = _Pending(
            inputs,
            outputs,
            rows,
            signature,
            now,
            deadline,
            asyncio.get_running_loop().create_future(),
            time.perf_counter_ns(),
        )
        self._queue.append(item)
        self._stats.pending = len(self._queue)
        if deadline is not None and deadline < self._next_deadline:
            self._next_deadline = deadline
        self._wake.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            try:
                self._queue.remove(item)  # still queued: nobody will resolve it now
                self._stats.pending = len(self._queue)
            except ValueError:
                pass  # already executing; its batch task will skip the done future
            raise

    def enqueue(
        self,
        request: InferenceRequest,
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
    ) -> Awaitable[BatchResult]:
        """The :class:`appliance.core.scheduler.Scheduler` entry: :meth:`submit` of
        ``request``'s inputs (no extra coroutine frame on the hot path)."""
        return self.submit(request.inputs, outputs, rows, signature, timeout_s)

    def _expire(self, now: float) -> None:
        if now < self._next_deadline:
            return
        keep: deque[_Pending] = deque()
        next_deadline = float("inf")
        for item in self._queue:
            if item.deadline is not None and item.deadline <= now:
                if not item.future.done():
                    item.future.set_exception(
                        unavailable(
                            f"request to model '{self.model}' timed out after "
                            f"{item.deadline - item.arrival:.3f}s in the queue",
                            FailureReason.REJECTED,
                        )
                    )
            else:
                keep.append(item)
                if item.deadline is not None:
                    next_deadline = min(next_deadline, item.deadline)
        self._queue = keep
        self._next_deadline = next_deadline
        self._stats.pending = len(keep)

    async def _schedule(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            self._expire(now)
            if not self._accepting and not self._queue:
                return
            wait_s: float | None = None
            if self._queue and self._instances.idle_count:
                # once stopping, waiting for fuller batches only delays the drain
                decision = decide(self._queue, now if self._accepting else math.inf, self.policy)
                if decision.send:
                    self._dispatch(decision.send)
                    continue
                wait_s = decision.wait_s
            if self._next_deadline != float("inf"):
                until = max(0.0, self._next_deadline - now)
                wait_s = until if wait_s is None else min(wait_s, until)
            # asyncio.TimeoutError is not the builtin TimeoutError on Python 3.10
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)

    def _dispatch(self, positions: tuple[int, ...]) -> None:
        chosen = set(positions)
        items = [self._queue[i] for i in positions]
        if len(positions) == 1 and positions[0] == 0:
            self._queue.popleft()
        else:
            self._queue = deque(x for i, x in enumerate(self._queue) if i not in chosen)
        self._stats.pending = len(self._queue)
        instance = self._instances.acquire()
        assert instance is not None  # the scheduler only decides when one is idle
        task = asyncio.get_running_loop().create_task(self._execute(instance, items))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(self, instance: ModelInstance, items: list[_Pending]) -> None:
        start_ns = time.perf_counter_ns()
        outputs = list(dict.fromkeys(name for it in items for name in it.outputs))
        rows = [it.rows for it in items]
        error: ApplianceError | None = None
        try:
            parts, input_ns, infer_ns, output_ns = await instance.run(
                run_batch,
                [it.inputs for it in items],
                rows,
                outputs,
                self.policy.max_batch_size > 0,
            )
        except ApplianceError as exc:
            error = exc
        except asyncio.CancelledError:  # stop() gave up waiting for this batch
            for it in items:
                if not it.future.done():
                    it.future.set_exception(
                        unavailable(
                            f"model '{self.model}' was unloaded while the request ran",
                            FailureReason.REJECTED,
                        )
                    )
            raise
        except Exception as exc:  # an engine error fails this batch only
            log.exception("model '%s': inference failed", self.model)
            error = internal(f"model '{self.model}' failed to run: {exc}", FailureReason.BACKEND)
        finally:
            self._instances.release(instance)
            self._wake.set()
        if error is not None:
            for it in items:
                if not it.future.done():
                    it.future.set_exception(error)
            return
        self._stats.record_execution(sum(rows), input_ns, infer_ns, output_ns)
        for it, part in zip(items, parts, strict=True):
            if not it.future.done():
                it.future.set_result(
                    BatchResult(
                        {k: part[k] for k in it.outputs},
                        start_ns - it.enqueued_ns,
                        input_ns,
                        infer_ns,
                        output_ns,
                    )
                )

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting, drain queued and running work for up to ``timeout_s``,
        then fail whatever is left with UNAVAILABLE and cancel the scheduler."""
        self._accepting = False
        self._wake.set()
        await wind_down(self._scheduler, self._running, timeout_s, self._fail_queued)

    def _fail_queued(self) -> None:
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    unavailable(
                        f"model '{self.model}' was unloaded before the request ran",
                        FailureReason.REJECTED,
                    )
                )
        self._queue.clear()
        self._stats.pending = 0


async def wind_down(
    scheduler: asyncio.Task[None],
    running: set[asyncio.Task[None]],
    timeout_s: float,
    fail_queued: Callable[[], None],
) -> None:
    """The stop both batchers share, once they stopped accepting and woke their
    scheduler: wait for the scheduler to return, let the batches it dispatched finish
    within what is left of ``timeout_s`` (only the scheduler dispatches, so once it has
    returned the running set is final), fail what is still queued, cancel what is late."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    await asyncio.wait({scheduler}, timeout=timeout_s)
    if running:
        await asyncio.wait(set(running), timeout=max(0.0, end - loop.time()))
    fail_queued()
    late = {t for t in (scheduler, *running) if not t.done()}
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late)
