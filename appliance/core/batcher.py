"""Dynamic batching: one bounded queue per model version, served by its instances'
own threads.

As in Triton's dynamic batcher, each instance's thread is its own scheduler: when
idle it takes the next batch from the queue (the decision is
:func:`appliance.core.batching.decide`), runs it, hands the results to the event
loop in one call and goes back to the queue. The event loop only appends requests
(``submit``) and resolves futures (one callback per batch); it never wakes a
scheduler task, creates a task per batch or waits for a thread to pick work up, so
an instance runs back to back however busy the loop is. Two rules from
:mod:`appliance.core.batching` shape the tail: an arrival wakes an instance waiting
out the delay only when it can change the decision (``wake_rows``), and a batch that
is not full waits, within the queue delay, for the loop to take the instance's last
answers (``catch_up``): the requests the loop reads meanwhile ride it.

Concurrency contract: the queue and the in-flight lists are guarded by one lock;
each request's future is resolved on the event loop by exactly one party, the
delivery of its batch (result, error), its timeout, or ``stop`` (unloaded), and
always after checking ``done()`` since the caller may have been cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Hashable
from dataclasses import dataclass, field

import numpy as np

from appliance.backends.base import Backend
from appliance.core import memory
from appliance.core.batching import (
    BatchPolicy,
    BatchResult,
    InlineCost,
    answer,
    catch_up,
    decide,
    failed_batch,
    run_batch,
    sends_alone,
    wake_rows,
)
from appliance.core.instances import InstanceGroup
from appliance.core.queue_bytes import CONTENDED
from appliance.core.stats import ModelStats
from appliance.decoupled import cancel_of
from appliance.errors import ApplianceError, FailureReason, internal, unavailable
from appliance.request import InferenceRequest

log = logging.getLogger(__name__)

# an idle instance thread looks up this often whether its batcher was abandoned
# (never stopped); a batcher that is stopped is woken at once
IDLE_CHECK_S = 1.0


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int
    signature: Hashable
    arrival: float  # time.monotonic()
    future: asyncio.Future[BatchResult] = field(repr=False)
    enqueued_ns: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    level: int = 0  # priority level: the queue is ordered by it, then by arrival


# what a batch came to: (parts, input_ns, infer_ns, output_ns), or the error it raised
_Outcome = tuple[list[dict[str, np.ndarray]], int, int, int] | Exception


class DynamicBatcher:
    """The queue of one model version and the loops of its instances.

    ``submit`` enqueues or rejects at once (queue full -> UNAVAILABLE); every idle
    instance thread takes the next batch. ``stop`` stops accepting, lets queued and
    running work finish within the timeout, then fails what is left with UNAVAILABLE.
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
        self._stats = stats
        self._loop = asyncio.get_running_loop()
        self._queue: deque[_Pending] = deque()
        self._wake_rows = wake_rows(policy)
        self._ready = threading.Condition(threading.Lock())  # guards everything below
        self._queued_rows = 0  # the rows of every queued request
        self._running: dict[int, list[_Pending]] = {}  # instance index -> its batch
        # instance index -> when it finished a batch whose answers the loop has not taken
        self._undelivered: dict[int, float] = {}
        self._accepting = True
        self._halted = False  # stop() gave up: instances take nothing more
        self._releasing: set[int] = set()  # instances asked to hand back working memory
        self._release_busy = 0  # instances handing it back now
        self._released: asyncio.Future[None] | None = None  # done when all have
        # the instances whose engine may run a cheap lone request on the event loop
        # (Backend.inline_safe: ONNX Runtime on the CPU), and what their runs cost
        self._inline_backends = [
            i.backend if getattr(i.backend, "inline_safe", False) else None
            for i in instances.instances
        ]
        self._inline = InlineCost() if any(self._inline_backends) else None
        self._batched = policy.max_batch_size > 0
        self._serving = [
            asyncio.wrap_future(instance.occupy(self._serve, index))
            for index, instance in enumerate(instances.instances)
        ]
        for serving in self._serving:
            serving.add_done_callback(self._serving_done)

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
        level: int = 0,
    ) -> BatchResult:
        """Queue one request and wait for its share of a batch, behind every queued
        request of its priority ``level`` or a more urgent one (a lower number).

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
        if (
            self._inline is not None
            and self._inline.cheap()
            and not CONTENDED.get()
            and sends_alone(self.policy, rows)
        ):
            with self._ready:
                index = self._claim()
            if index is not None:
                return self._run_inline(index, inputs, outputs, rows)
        item = _Pending(
            inputs,
            outputs,
            rows,
            signature,
            time.monotonic(),
            self._loop.create_future(),
            time.perf_counter_ns(),
            level=level,
        )
        if timeout_s:
            item.timer = self._loop.call_later(timeout_s, self._expire, item, timeout_s)
        with self._ready:
            was_empty = not self._queue
            ahead = bool(level and self._queue and self._queue[-1].level > level)
            if ahead:  # ahead of less urgent requests: a new head may change the decision
                _insert_by_level(self._queue, item)
            else:
                self._queue.append(item)
            self._queued_rows += rows
            self._stats.pending = len(self._queue)
            # an instance waiting out the delay is woken only when this arrival can
            # change its decision (batching.wake_rows, or another shape than the
            # batch's, which ends it), not for every request
            if (
                was_empty
                or ahead
                or self._queued_rows >= self._wake_rows
                or signature != self._queue[0].signature
            ):
                self._ready.notify()
        try:
            return await item.future
        except asyncio.CancelledError:
            # still queued: nobody will resolve it now; already running: the model may
            # see that its caller went away (a Python model's ``is_cancelled()``)
            if not self._withdraw(item) and (flag := cancel_of(item.inputs)) is not None:
                flag.set()
            raise

    # ---- a cheap lone request, on the event loop --------------------------------------

    def _claim(self) -> int | None:
        """An idle instance whose engine may run on the loop, marked running (so its
        thread takes nothing meanwhile: only the loop enqueues, and it is busy), or
        None: something is queued, or no such instance is idle. Under the lock."""
        if self._queue or self._releasing or self._release_busy or not self._accepting:
            return None
        for index, backend in enumerate(self._inline_backends):
            idle = index not in self._running and index not in self._undelivered
            if backend is not None and idle:
                self._running[index] = []
                return index
        return None

    def _run_inline(
        self, index: int, inputs: dict[str, np.ndarray], outputs: tuple[str, ...], rows: int
    ) -> BatchResult:
        """Run one request on the claimed instance's engine here, on the event loop:
        no queue entry, no thread hand-off either way (docs/benchmarks.md)."""
        backend = self._inline_backends[index]
        assert backend is not None and self._inline is not None  # (claimed: inline-safe)
        start_ns = time.perf_counter_ns()
        try:
            parts, input_ns, infer_ns, output_ns = run_batch(
                backend, [inputs], [rows], list(outputs), self._batched
            )
        except Exception as exc:
            raise failed_batch(self.model, exc) from None
        finally:
            with self._ready:
                self._running.pop(index, None)
            self._inline.record(time.perf_counter_ns() - start_ns, inline=True)
        self._stats.record_execution(rows, input_ns, infer_ns, output_ns)
        part = parts[0]
        return BatchResult(
            {k: part[k] for k in outputs if k in part}, 0, input_ns, infer_ns, output_ns
        )

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
        level = self.policy.level(request.priority)
        return self.submit(request.inputs, outputs, rows, signature, timeout_s, level)

    def _withdraw(self, item: _Pending) -> bool:
        """Take ``item`` out of the queue if no instance took it yet."""
        if item.timer is not None:
            item.timer.cancel()
        with self._ready:
            try:
                self._queue.remove(item)
            except ValueError:
                return False  # already executing: its delivery skips the done future
            self._queued_rows -= item.rows
            self._stats.pending = len(self._queue)
        return True

    def _expire(self, item: _Pending, timeout_s: float) -> None:
        if self._withdraw(item) and not item.future.done():
            item.future.set_exception(
                unavailable(
                    f"request to model '{self.model}' timed out after {timeout_s:.3f}s "
                    "in the queue",
                    FailureReason.REJECTED,
                )
            )

    # ---- an instance's thread ------------------------------------------------------------

    def _take(self, index: int) -> list[_Pending] | None:
        """Wait for the next batch (None: stop serving)."""
        with self._ready:
            while True:
                if self._halted or (not self._accepting and not self._queue):
                    return None
                if self._abandoned():
                    return None
                if index in self._releasing and not self._queue:
                    self._releasing.discard(index)
                    self._release_busy += 1
                    return []  # (an empty batch: hand back working memory)
                wait_s = IDLE_CHECK_S
                if self._queue:
                    # once stopping, waiting for fuller batches only delays the drain
                    now = time.monotonic() if self._accepting else math.inf
                    decision = decide(self._queue, now, self.policy)
                    if decision.send:
                        catch_up = self._catch_up_s(index, decision.send)
                        if catch_up <= 0:
                            return self._pop(index, decision.send)
                        wait_s = min(wait_s, catch_up)
                    elif decision.wait_s is not None:
                        wait_s = min(wait_s, decision.wait_s)
                self._ready.wait(wait_s)

    def _catch_up_s(self, index: int, send: tuple[int, ...]) -> float:
        """How long this instance holds the batch ``send`` for the loop to take its last
        answers (:func:`appliance.core.batching.catch_up`); 0 when stopping."""
        since = self._undelivered.get(index)
        if since is None or not self._accepting:
            return 0.0
        rows = sum(self._queue[i].rows for i in send)
        return catch_up(self.policy, rows, since, time.monotonic())

    def _abandoned(self) -> bool:
        """Nobody will ever stop this batcher: its event loop is closed, or the
        interpreter is exiting (which joins every executor thread, this one too)."""
        return self._loop.is_closed() or getattr(concurrent.futures.thread, "_shutdown", False)

    def _pop(self, index: int, positions: tuple[int, ...]) -> list[_Pending]:
        if positions == (0,):
            items = [self._queue.popleft()]
        else:
            chosen = set(positions)
            items = [self._queue[i] for i in positions]
            self._queue = deque(x for i, x in enumerate(self._queue) if i not in chosen)
        self._queued_rows -= sum(it.rows for it in items)
        self._stats.pending = len(self._queue)
        self._running[index] = items
        if self._queue:
            self._ready.notify()  # another idle instance may take what is left
        return items

    def _serve(self, backend: Backend, index: int) -> None:
        """An instance's loop, on its own thread: take a batch, run it, deliver it."""
        batched = self._batched
        while (items := self._take(index)) is not None:
            if not items:
                self._release(backend)
                continue
            start_ns = time.perf_counter_ns()
            outputs = list(dict.fromkeys(out for it in items for out in it.outputs))
            outcome: _Outcome
            try:
                outcome = run_batch(
                    backend,
                    [it.inputs for it in items],
                    [it.rows for it in items],
                    outputs,
                    batched,
                )
            except Exception as exc:  # delivered as this batch's error
                outcome = exc
            with self._ready:
                self._running.pop(index, None)
                self._undelivered[index] = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(self._deliver, items, outcome, start_ns, index)
            except RuntimeError:  # the event loop is gone: nobody is waiting any more
                return
            del items, outcome  # the inputs are not held while waiting for the next batch

    def _release(self, backend: Backend) -> None:
        try:
            memory.hand_back(backend)
        except Exception:  # a backend's bug: its memory stays, serving goes on
            log.exception("model '%s': handing back working memory failed", self.model)
        with self._ready:
            self._release_busy -= 1
            done = not self._releasing and not self._release_busy
        if done:
            with contextlib.suppress(RuntimeError):  # (the event loop is gone)
                self._loop.call_soon_threadsafe(self._release_done)

    def _serving_done(self, serving: asyncio.Future[None]) -> None:
        """An instance loop that died of a bug must not strand the callers."""
        if serving.cancelled() or serving.exception() is None:
            return
        log.error("model '%s': batch scheduler failed", self.model, exc_info=serving.exception())
        self._accepting = False
        self._fail_all(internal(f"model '{self.model}' scheduler failed"))

    # ---- the event loop's side -----------------------------------------------------------

    def _deliver(self, items: list[_Pending], outcome: _Outcome, start_ns: int, index: int) -> None:
        with self._ready:
            if self._undelivered.pop(index, None) is not None:
                self._ready.notify_all()  # the instance may hold a batch for this
        for it in items:
            if it.timer is not None:
                it.timer.cancel()
        if isinstance(outcome, Exception):
            error = failed_batch(self.model, outcome)
            for it in items:
                if not it.future.done():
                    it.future.set_exception(error)
            return
        parts, input_ns, infer_ns, output_ns = outcome
        self._stats.record_execution(sum(it.rows for it in items), input_ns, infer_ns, output_ns)
        if self._inline is not None and len(items) == 1:
            self._inline.record(input_ns + infer_ns + output_ns, inline=False)
        for it, part in zip(items, parts, strict=True):
            answer(
                it.future,
                part,
                it.outputs,
                start_ns - it.enqueued_ns,
                input_ns,
                infer_ns,
                output_ns,
            )

    def _fail_all(self, error: ApplianceError, running: ApplianceError | None = None) -> None:
        """Fail every queued request with ``error`` (and, given ``running``, every
        request an instance is still running with that)."""
        with self._ready:
            queued, self._queue = list(self._queue), deque()
            self._queued_rows = 0
            busy = [it for items in self._running.values() for it in items]
            self._stats.pending = 0
        failed = [(it, error) for it in queued]
        if running is not None:
            failed += [(it, running) for it in busy]
        for it, why in failed:
            if it.timer is not None:
                it.timer.cancel()
            if not it.future.done():
                it.future.set_exception(why)

    def release_memory(self) -> asyncio.Future[None]:
        """Ask each instance to hand back the working memory its engine keeps
        (:func:`appliance.backends.base.release_memory`), on its own thread between
        batches; the future is done once every instance has (or the batcher stopped)."""
        with self._ready:
            if self._released is None or self._released.done():
                self._released = self._loop.create_future()
            if not self._accepting or self._halted:
                self._released.set_result(None)
                return self._released
            self._releasing = set(range(len(self._serving)))
            self._ready.notify_all()
            return self._released

    def _release_done(self) -> None:
        if self._released is not None and not self._released.done():
            self._released.set_result(None)

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting, drain queued and running work for up to ``timeout_s``,
        then fail whatever is left with UNAVAILABLE; the instances take nothing more
        (a batch still running finishes on its thread, its answer dropped)."""
        with self._ready:
            self._accepting = False
            self._releasing.clear()
            self._ready.notify_all()
        self._release_done()
        if not self._serving:
            return
        _, late = await asyncio.wait(self._serving, timeout=timeout_s)
        if not late:
            return
        with self._ready:
            self._halted = True
            self._ready.notify_all()
        self._fail_all(
            unavailable(
                f"model '{self.model}' was unloaded before the request ran",
                FailureReason.REJECTED,
            ),
            unavailable(
                f"model '{self.model}' was unloaded while the request ran",
                FailureReason.REJECTED,
            ),
        )
        # one turn of the loop: the callers' wake-ups, scheduled as their futures
        # failed, run before stop() returns (so its caller sees them answered)
        await asyncio.sleep(0)


def _insert_by_level(queue: deque[_Pending], item: _Pending) -> None:
    """Put ``item`` behind the last queued request of its level or a more urgent one."""
    at = len(queue)
    while at and queue[at - 1].level > item.level:
        at -= 1
    queue.insert(at, item)
