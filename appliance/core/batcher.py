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

A cheap model's lone request skips the threads: with no other request in flight it
runs on the loop, at once or after its queue delay held there (:mod:`appliance.core.lone`).

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
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import numpy as np

from appliance.backends.base import Backend
from appliance.config.scheduling_config import RateLimiterConfig
from appliance.core import memory
from appliance.core.batch_queue import (
    BatchQueue,
    Levels,
    Pending,
    fail,
    queue_full,
    timed_out,
    unloaded,
)
from appliance.core.batching import (
    BatchPolicy,
    BatchResult,
    Outcome,
    answer,
    attempt_batch,
    failed_batch,
    next_batch,
    sends_alone,
    wake_rows,
)
from appliance.core.hand_back import HandBack
from appliance.core.inline import InlineRunner
from appliance.core.instances import InstanceGroup
from appliance.core.lone import LoneRequests
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
        self._hand_back = HandBack()  # rounds handing engines' working memory back
        self._batched = policy.max_batch_size > 0
        # a cheap lone request, run or held on the event loop (None: no engine may run there)
        self._lone: LoneRequests | None = None
        if runner := InlineRunner.of([i.backend for i in instances.instances]):
            self._lone = LoneRequests(
                runner,
                model,
                self._batched,
                policy.max_queue_delay_s,
                stats,
                self._claim,
                self._unclaim,
                self._arrive,
            )
        # the server's rate limiter (None: off): each instance's ticket, one per instance
        self._limiter = limiter
        self._tickets: list[Ticket] = []
        if limiter is not None:
            self._tickets = limiter.register(model, limits, len(instances.instances), self._notify)
            self._lone = None  # every run takes its turn with the limiter
        self._serving = [
            asyncio.wrap_future(instance.occupy(self._serve, index))
            for index, instance in enumerate(instances.instances)
        ]
        for serving in self._serving:
            serving.add_done_callback(self._serving_done)

    @property
    def pending(self) -> int:
        return len(self._queue.items) + bool(self._lone and self._lone.held)

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
        lone, holder = self._lone, None
        if lone is not None and lone.held is not None:  # it batches with this arrival
            lone.to_queue()  # (first: it counts against the queue's bound)
        if self._queue.full(level):
            raise queue_full(request_id)
        if lone is not None and lone.runner.cost.cheap() and not CONTENDED.get():
            if sends_alone(self.policy, rows):
                if (result := lone.run(inputs, outputs, rows)) is not None:
                    return result
            elif lone.can_hold():  # it waits out the queue delay on the loop
                holder = lone
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
        if holder is not None:
            holder.hold(item)
        else:
            self._arrive(item)
        try:
            return await item.future
        except asyncio.CancelledError:
            # still queued: nobody will resolve it now; already running: the model may
            # see that its caller went away (a Python model's ``is_cancelled()``)
            if not self._withdraw(item) and (flag := cancel_of(item.inputs)) is not None:
                flag.set()
            raise

    def _arrive(self, item: Pending) -> None:
        """Queue ``item`` for the instances' threads (waking one if it may change what
        it decides)."""
        with self._ready:
            wakes = self._queue.arrive(item, self._wake_rows)
            self._stats.pending = len(self._queue.items)
            if wakes:
                self._ready.notify()

    # ---- a cheap lone request, on the event loop (core/lone) ---------------------------

    def _claim(self, keep: bool) -> int | None:
        """An idle instance whose engine may run on the loop, when nothing is queued
        (None: none); ``keep``: marked running, so its thread takes nothing meanwhile
        (only the loop enqueues, and it is busy with the run)."""
        assert self._lone is not None
        with self._ready:
            if self._queue.items or self._hand_back.active or not self._accepting:
                return None
            index = self._lone.runner.idle(self._running, self._undelivered)
            if index is not None and keep:
                self._running[index] = []
            return index

    def _unclaim(self, index: int) -> None:
        with self._ready:
            self._running.pop(index, None)

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
        if self._lone is not None and item is self._lone.held:
            self._lone.take()
            return True
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
                    since = self._undelivered.get(index)
                    send, wait_s = next_batch(
                        self._queue.items, self.policy, since, self._accepting, IDLE_CHECK_S
                    )
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
                if self._hand_back.take(index, not self._queue.items):
                    return []  # (an empty batch: hand back working memory)
                self._ready.wait(wait_s)

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
            inputs, rows = [it.inputs for it in items], [it.rows for it in items]
            outcome = attempt_batch(backend, inputs, rows, outputs, batched)
            del inputs
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
            over = self._hand_back.finished()
        if over:
            with contextlib.suppress(RuntimeError):  # (the event loop is gone)
                self._loop.call_soon_threadsafe(self._hand_back.done)

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

    def _deliver(self, items: list[Pending], outcome: Outcome, start_ns: int, index: int) -> None:
        with self._ready:
            # an instance holds a batch for these answers only when something is queued
            # (else waking it costs a context switch and a turn for the lock, for nothing)
            if self._undelivered.pop(index, None) is not None and self._queue.items:
                self._ready.notify_all()
        if isinstance(outcome, Exception):
            error = failed_batch(self.model, outcome)
            for it in items:
                fail(it, error)
            return
        for it in items:
            if it.timer is not None:
                it.timer.cancel()
        parts, input_ns, infer_ns, output_ns = outcome
        self._stats.record_execution(sum(it.rows for it in items), input_ns, infer_ns, output_ns)
        if self._lone is not None and len(items) == 1:
            self._lone.runner.cost.record(input_ns + infer_ns + output_ns, inline=False)
        for it, part in zip(items, parts, strict=True):
            queue_ns = start_ns - it.enqueued_ns
            answer(it.future, part, it.outputs, queue_ns, input_ns, infer_ns, output_ns)

    def _fail_all(self, error: ApplianceError, running: ApplianceError | None = None) -> None:
        """Fail every queued request with ``error`` (and, given ``running``, every
        request an instance is still running with that)."""
        if self._lone is not None:
            self._lone.to_queue()
        with self._ready:
            queued = self._queue.clear()
            busy = [it for items in self._running.values() for it in items]
            self._stats.pending = 0
        failed = [(it, error) for it in queued]
        if running is not None:
            failed += [(it, running) for it in busy]
        for it, why in failed:
            fail(it, why)

    def release_memory(self) -> asyncio.Future[None]:
        """Ask each instance to hand back the working memory its engine keeps
        (:func:`appliance.backends.base.release_memory`), on its own thread between
        batches; the future is done once every instance has (or the batcher stopped)."""
        with self._ready:
            open_ = self._accepting and not self._halted
            round_ = self._hand_back.ask(self._loop, len(self._serving), open_)
            self._ready.notify_all()
            return round_

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting, drain queued and running work for up to ``timeout_s``,
        then fail whatever is left with UNAVAILABLE; the instances take nothing more
        (a batch still running finishes on its thread, its answer dropped)."""
        if self._lone is not None:
            self._lone.to_queue()  # (drained with the queue)
            self._lone.close()
        with self._ready:
            self._accepting = False
            self._hand_back.cancel()
            self._ready.notify_all()
        self._hand_back.done()
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
        self._fail_all(unloaded(self.model, "before"), unloaded(self.model, "while"))
        # one turn of the loop: the callers' wake-ups, scheduled as their futures
        # failed, run before stop() returns (so its caller sees them answered)
        await asyncio.sleep(0)
