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
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import numpy as np

from appliance.backends.base import Backend
from appliance.config.scheduling_config import RateLimiterConfig
from appliance.core import memory
from appliance.core.batch_queue import BatchQueue, Levels, Pending, queue_full, timed_out
from appliance.core.batching import (
    INLINE_BOUND_NS,
    BatchPolicy,
    BatchResult,
    InlineCost,
    answer,
    catch_up,
    decide,
    failed_batch,
    run_alone,
    run_batch,
    sends_alone,
    wake_rows,
)
from appliance.core.instances import InstanceGroup
from appliance.core.queue_bytes import CONTENDED
from appliance.core.rate_limiter import RateLimiter, Ticket, take_turn, wake
from appliance.core.stats import ModelStats
from appliance.decoupled import cancel_of
from appliance.errors import ApplianceError, FailureReason, internal, unavailable
from appliance.request import InferenceRequest

log = logging.getLogger(__name__)

# an idle instance thread looks up this often whether its batcher was abandoned
# (never stopped); a batcher that is stopped is woken at once
IDLE_CHECK_S = 1.0


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
        levels: Levels | None = None,
        call_later: Callable[..., Any] | None = None,
        limiter: RateLimiter | None = None,
        limits: Sequence[RateLimiterConfig | None] = (),
    ) -> None:
        self.model = model
        self.policy = policy
        # each priority level's queue policy (bounded by max_queue_size where it sets none)
        self.levels = levels or Levels(None, max_queue_size)
        self._stats = stats
        self._loop = asyncio.get_running_loop()
        # arms a request's queue timeout (the loop's timers; a test may pass its own clock)
        self._call_later = call_later or self._loop.call_later
        self._queue = BatchQueue(self.levels)
        self._wake_rows = wake_rows(policy)
        self._ready = threading.Condition(threading.Lock())  # guards everything below
        self._running: dict[int, list[Pending]] = {}  # instance index -> its batch
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
        # the server's rate limiter (None: off): each instance's ticket, one per instance
        self._limiter = limiter
        self._tickets: list[Ticket] = []
        if limiter is not None:
            self._tickets = limiter.register(model, limits, len(instances.instances), self._notify)
            self._inline = None  # every run takes its turn with the limiter
        self._serving = [
            asyncio.wrap_future(instance.occupy(self._serve, index))
            for index, instance in enumerate(instances.instances)
        ]
        for serving in self._serving:
            serving.add_done_callback(self._serving_done)

    @property
    def pending(self) -> int:
        return len(self._queue.items)

    async def submit(
        self,
        inputs: dict[str, np.ndarray],
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
        level: int = 0,
        request_id: str = "",
    ) -> BatchResult:
        """Queue one request and wait for its share of a batch, behind every queued
        request of its priority ``level`` or a more urgent one (a lower number).

        Raises UNAVAILABLE (reason REJECTED) when its level's queue is full, the
        request timed out in the queue under REJECT (under DELAY it stays, behind its
        level), or the model is stopping; cancelling the await removes the request
        from the queue if it has not started executing.
        """
        if not self._accepting:
            raise unavailable(f"model '{self.model}' is unloading", FailureReason.REJECTED)
        if self._queue.full(level):
            raise queue_full(request_id)
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
        item = Pending(
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
            item.timer = self._call_later(timeout_s, self._expire, item)
        with self._ready:
            was_empty = not self._queue.items
            # ahead of less urgent (or delayed) requests: a new head may change the decision
            ahead = self._queue.push(item)
            self._stats.pending = len(self._queue.items)
            # an instance waiting out the delay is woken only when this arrival can
            # change its decision (batching.wake_rows, or another shape than the
            # batch's, which ends it), not for every request
            if (
                was_empty
                or ahead
                or self._queue.rows >= self._wake_rows
                or signature != self._queue.items[0].signature
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
        if self._queue.items or self._releasing or self._release_busy or not self._accepting:
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
        start_ns, cpu0_ns = time.perf_counter_ns(), time.thread_time_ns()
        try:
            result = run_alone(self.model, backend, inputs, outputs, rows, self._batched)
        finally:
            with self._ready:
                self._running.pop(index, None)
            wall_ns = time.perf_counter_ns() - start_ns
            cpu_ns = None
            if wall_ns > 4 * INLINE_BOUND_NS:  # slow, or the thread lost the CPU?
                cpu_ns = time.thread_time_ns() - cpu0_ns
            self._inline.record(wall_ns, inline=True, cpu_ns=cpu_ns)
        self._stats.record_execution(rows, result.input_ns, result.infer_ns, result.output_ns)
        return result

    def enqueue(
        self,
        request: InferenceRequest,
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
    ) -> Awaitable[BatchResult]:
        """The :class:`appliance.core.scheduler.Scheduler` entry: :meth:`submit` of
        ``request``'s inputs (no extra coroutine frame on the hot path). The queue
        timeout is the request's level's (:meth:`Levels.timeout_s`), not ``timeout_s``
        (the model's default policy's, which the sequence batcher takes)."""
        level = self.policy.level(request.priority)
        timeout_s = self.levels.timeout_s(level, request.timeout_us)
        return self.submit(request.inputs, outputs, rows, signature, timeout_s, level, request.id)

    def _withdraw(self, item: Pending) -> bool:
        """Take ``item`` out of the queue if no instance took it yet."""
        if item.timer is not None:
            item.timer.cancel()
        with self._ready:
            if not self._queue.remove(item):
                return False  # already executing: its delivery skips the done future
            self._stats.pending = len(self._queue.items)
        return True

    def _expire(self, item: Pending) -> None:
        """A request's queue timeout passed (its timer, on the loop): REJECT answers it
        now; DELAY moves it behind the rest of its level."""
        item.timer = None
        if self.levels.delays(item.level):
            with self._ready:
                if self._queue.delay(item):  # (a new head may change the decision)
                    self._ready.notify()
            return
        if self._withdraw(item) and not item.future.done():
            item.future.set_exception(timed_out())

    # ---- an instance's thread ------------------------------------------------------------

    def _take(self, index: int) -> list[Pending] | None:
        """Wait for the next batch (None: stop serving)."""
        limiter, ticket = self._limiter, self._tickets[index] if self._tickets else None
        with self._ready:
            while True:
                stop = self._halted or (not self._accepting and not self._queue.items)
                stop = stop or self._abandoned()
                send: tuple[int, ...] = ()
                wait_s = IDLE_CHECK_S
                if self._queue.items and not stop:
                    # once stopping, waiting for fuller batches only delays the drain
                    now = time.monotonic() if self._accepting else math.inf
                    decision = decide(self._queue.items, now, self.policy)
                    if decision.send:
                        catch_up = self._catch_up_s(index, decision.send)
                        if catch_up <= 0:
                            send = decision.send
                        wait_s = min(wait_s, catch_up) if catch_up > 0 else wait_s
                    elif decision.wait_s is not None:
                        wait_s = min(wait_s, decision.wait_s)
                if limiter and ticket and (send or ticket.wanting):
                    # the rate limiter: send only holding the resources (else wait in line)
                    turn = take_turn(limiter, ticket, bool(send), self._ready)
                    if turn is None:
                        continue  # the lock was let go: look again
                    send = send if turn else ()
                if stop:
                    return None
                if send:
                    return self._pop(index, send)
                if index in self._releasing and not self._queue.items:
                    self._releasing.discard(index)
                    self._release_busy += 1
                    return []  # (an empty batch: hand back working memory)
                self._ready.wait(wait_s)

    def _catch_up_s(self, index: int, send: tuple[int, ...]) -> float:
        """How long this instance holds the batch ``send`` for the loop to take its last
        answers (:func:`appliance.core.batching.catch_up`); 0 when stopping."""
        since = self._undelivered.get(index)
        if since is None or not self._accepting:
            return 0.0
        rows = sum(self._queue.items[i].rows for i in send)
        return catch_up(self.policy, rows, since, time.monotonic())

    def _abandoned(self) -> bool:
        """Nobody will ever stop this batcher: its event loop is closed, or the
        interpreter is exiting (which joins every executor thread, this one too)."""
        return self._loop.is_closed() or getattr(concurrent.futures.thread, "_shutdown", False)

    def _pop(self, index: int, positions: tuple[int, ...]) -> list[Pending]:
        items = self._queue.pop(positions)
        self._stats.pending = len(self._queue.items)
        self._running[index] = items
        if self._queue.items:
            self._ready.notify()  # another idle instance may take what is left
        return items

    def _serve(self, backend: Backend, index: int) -> None:
        try:
            self._serve_batches(backend, index)
        finally:  # (a loop that died of a bug must not keep the rate limiter's resources)
            if self._limiter:
                wake(self._limiter.withdraw(self._tickets[index]))

    def _serve_batches(self, backend: Backend, index: int) -> None:
        """An instance's loop, on its own thread: take a batch, run it, deliver it."""
        batched, limiter = self._batched, self._limiter
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
            if limiter:  # the resources go back (to the next instance in line)
                wake(limiter.release(self._tickets[index]))
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

    def _notify(self) -> None:
        """The rate limiter granted an instance its resources: its thread looks again."""
        with self._ready:
            self._ready.notify_all()

    def _serving_done(self, serving: asyncio.Future[None]) -> None:
        """An instance loop that died of a bug must not strand the callers."""
        if serving.cancelled() or serving.exception() is None:
            return
        log.error("model '%s': batch scheduler failed", self.model, exc_info=serving.exception())
        self._accepting = False
        self._fail_all(internal(f"model '{self.model}' scheduler failed"))

    # ---- the event loop's side -----------------------------------------------------------

    def _deliver(self, items: list[Pending], outcome: _Outcome, start_ns: int, index: int) -> None:
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
            queued = self._queue.clear()
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
        if self._limiter is not None:  # (a batch still running keeps its resources)
            wake(self._limiter.unregister(self._tickets))
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
