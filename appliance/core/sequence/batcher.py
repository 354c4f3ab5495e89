"""Triton's sequence batcher: every request of a sequence on one instance, in order.

A sequence is a run of requests sharing a correlation id (``sequence_id``), the
first flagged ``sequence_start``, the last ``sequence_end``. On START it gets a
*slot* on one instance (a lane) and keeps it until END or until it idles longer
than ``max_sequence_idle_microseconds``; sequences without a free slot wait in a
backlog, oldest first. A lane runs one batch at a time, a batch holds at most one
request per sequence, and a sequence's requests queue in arrival order, so the
model sees them in order on one instance. This module queues, dispatches and
executes; the slot bookkeeping is :mod:`appliance.core.sequence.slots`, which ready
requests form a batch :mod:`appliance.core.sequence.strategy`, and what the model is
fed besides the request's inputs (controls, implicit state)
:mod:`appliance.core.sequence.feed`. docs/sequence-batching.md has the user's view.

Concurrency contract: everything runs on the event loop except the model call,
which runs on the lane's instance thread. Each request's future is resolved once,
by the batch task (result, error), by ``stop`` or by the scheduler's guard, always
after checking ``done()``. Cancelling a queued request removes it from its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Hashable
from typing import Any

from appliance.config.model_config import ModelConfig
from appliance.core import memory
from appliance.core.batching import (
    BatchPolicy,
    BatchResult,
    answer,
    failed_batch,
    run_batch,
    wind_down,
)
from appliance.core.instances import InstanceGroup
from appliance.core.sequence.feed import Feed
from appliance.core.sequence.slots import Lane, Queued, Sequence, SlotTable
from appliance.core.sequence.strategy import plan_direct, plan_oldest
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, FailureReason, internal, invalid, unavailable
from appliance.request import InferenceRequest

log = logging.getLogger(__name__)


class SequenceBatcher:
    """The scheduler of a model with ``sequence_batching`` (see the module docstring).

    ``enqueue`` checks the sequence flags at once (INVALID_ARG for a request that
    is not in a started sequence, UNAVAILABLE when full or stopping); ``stop``
    stops accepting, lets queued and running work finish within the timeout,
    then fails what is left with UNAVAILABLE.
    """

    def __init__(
        self,
        label: str,
        config: ModelConfig,
        instances: InstanceGroup,
        stats: ModelStats,
        max_queue_size: int,
    ) -> None:
        sb = config.sequence_batching
        assert sb is not None  # chosen by appliance.core.scheduler for exactly these configs
        self.model = config.name
        self.label = label
        self.max_queue_size = max_queue_size
        self._sb = sb
        self._feed = Feed(config)
        self._stats = stats
        self._batched = config.batch_size > 0
        slots = max(1, config.batch_size)
        if sb.strategy == "oldest" and sb.max_candidate_sequences > 0:
            slots = sb.max_candidate_sequences
        self._instances = instances.instances
        self._slots = SlotTable(
            config.name, instances.instances, slots, sb.max_sequence_idle_us / 1e6
        )
        self._policy = BatchPolicy(
            max_batch_size=config.batch_size,
            preferred_batch_sizes=sb.preferred_batch_size,
            max_queue_delay_s=sb.max_queue_delay_us / 1e6,
            dynamic=self._batched,
        )
        self._queued = 0
        self._accepting = True
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()  # hard refs so tasks aren't GC'd
        self._scheduler = asyncio.get_running_loop().create_task(
            self._schedule(), name=f"sequence-batcher:{label}"
        )
        self._scheduler.add_done_callback(self._scheduler_done)

    @property
    def pending(self) -> int:
        return self._queued

    @property
    def active_sequences(self) -> int:
        """Sequences holding a slot or waiting in the backlog (not yet released)."""
        return self._slots.active

    # ---- accepting requests ------------------------------------------------------------

    async def enqueue(
        self,
        request: InferenceRequest,
        outputs: tuple[str, ...],
        rows: int,
        signature: Hashable,
        timeout_s: float | None,
    ) -> BatchResult:
        """Queue ``request`` behind the earlier requests of its sequence and wait for
        its result. ``timeout_s`` does not apply: a sequence's requests are never
        dropped from the middle of it."""
        key = request.sequence_id
        if not self._accepting:
            raise unavailable(f"model '{self.model}' is unloading", FailureReason.REJECTED)
        if key == 0 or key == "":
            raise invalid(
                f"inference request to model '{self.model}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        if rows > 1:
            raise invalid(
                f"inference request to model '{self.model}' must specify batch-size 1 due "
                "to requirements of sequence batcher"
            )
        self._feed.check_id(key)
        seq = self._slots.get(key)
        if seq is None and not request.sequence_start:
            raise invalid(
                f"inference request for sequence {key} to model '{self.model}' must "
                "specify the START flag on the first request of the sequence"
            )
        if self._queued >= self.max_queue_size:
            raise unavailable(
                f"model '{self.model}' is overloaded: its queue is full "
                f"({self.max_queue_size} requests waiting)",
                FailureReason.REJECTED,
            )
        now = time.monotonic()
        if seq is None:
            seq = self._slots.open(key)
        elif request.sequence_start:
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not "
                "end before this sequence start. Previous sequence will be terminated early.",
                key,
                self.model,
            )
        self._slots.touch(seq, now)
        if request.sequence_end:  # a later START with this id opens a new sequence
            self._slots.close(seq)
        item = Queued(
            request,
            outputs,
            signature,
            seq,
            now,
            asyncio.get_running_loop().create_future(),
            time.perf_counter_ns(),
        )
        seq.queue.append(item)
        self._count(1)
        self._wake.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            try:
                seq.queue.remove(item)  # still queued: nobody will resolve it now
                self._count(-1)
                self._release(seq)
            except ValueError:
                pass  # already executing; its batch task will skip the done future
            raise

    def _count(self, delta: int) -> None:
        self._queued += delta
        self._stats.pending = self._queued

    def _release(self, seq: Sequence) -> None:
        if self._slots.release_if_done(seq):
            self._wake.set()  # a backlogged sequence got the slot

    def _pick(self, lane: Lane, now: float) -> tuple[list[Queued | None], float | None]:
        """The batch for an idle lane (None rows are direct-strategy fillers), or how
        long to wait before it may change."""
        heads = [(i, s.queue[0]) for i, s in enumerate(lane.slots) if s is not None and s.queue]
        if not heads:
            return [], None
        if self._sb.strategy == "oldest":
            ordered = sorted((q for _, q in heads), key=lambda q: q.arrival)
            picked, wait_s = plan_oldest(ordered, now, self._policy)
            return [ordered[i] for i in picked], wait_s
        plan = plan_direct(
            [(i, q.signature, q.arrival) for i, q in heads],
            len(lane.slots),
            now,
            self._policy.max_queue_delay_s,
            self._sb.minimum_slot_utilization,
        )
        by_slot = dict(heads)
        return [by_slot[i] if i >= 0 else None for i in plan.rows], plan.wait_s

    async def _schedule(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            wait_until = self._slots.reap(now)
            if not self._accepting and not self._queued:
                return  # stop() waits for the batches still running
            for lane in self._slots.lanes:
                if lane.busy:
                    continue
                batch, wait_s = self._pick(lane, now if self._accepting else math.inf)
                if batch:
                    self._dispatch(lane, batch)
                elif wait_s is not None:
                    wait_until = min(wait_until, now + wait_s)
            timeout = None if wait_until == math.inf else max(0.0, wait_until - now)
            # asyncio.TimeoutError is not the builtin TimeoutError on Python 3.10
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _dispatch(self, lane: Lane, batch: list[Queued | None]) -> None:
        for q in batch:
            if q is not None:
                q.sequence.queue.popleft()
                q.sequence.running = True
        self._count(-sum(q is not None for q in batch))
        lane.busy = True
        task = asyncio.get_running_loop().create_task(self._execute(lane, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(self, lane: Lane, batch: list[Queued | None]) -> None:
        start_ns = time.perf_counter_ns()
        real = [q for q in batch if q is not None]
        template = real[0]
        feeds = []
        for q in batch:
            if q is None:
                feeds.append(self._feed.filler(template.request.inputs, template.sequence.state))
                continue
            seq, req = q.sequence, q.request
            if req.sequence_start or seq.state is None:
                seq.state = self._feed.initial_state()
            feeds.append(self._feed.inputs(req, seq.state))
        outputs = list(dict.fromkeys(name for q in real for name in q.outputs))
        outputs += [n for n in self._feed.state_outputs if n not in outputs]
        error: ApplianceError | None = None
        try:
            parts, input_ns, infer_ns, output_ns = await lane.instance.run(
                run_batch, feeds, [1] * len(feeds), outputs, self._batched
            )
            lost = sorted({n for n in self._feed.state_outputs for p in parts if n not in p})
            if lost:
                raise internal(f"the backend did not return the state output(s) {lost}")
        except asyncio.CancelledError:  # stop() gave up waiting for this batch
            error = unavailable(
                f"model '{self.model}' was unloaded while the request ran", FailureReason.REJECTED
            )
            raise
        except Exception as exc:
            error = failed_batch(self.model, exc)
        finally:
            if error is not None:
                for q in real:
                    if not q.future.done():
                        q.future.set_exception(error)
            lane.busy = False
            for q in real:
                q.sequence.running = False
                self._release(q.sequence)
            self._wake.set()
        if error is not None:
            return
        self._stats.record_execution(len(real), input_ns, infer_ns, output_ns)
        for q, part in zip(batch, parts, strict=True):
            if q is None:
                continue
            if q.sequence.lane is not None or not q.sequence.closing:
                q.sequence.state = self._feed.next_state(part)
            answer(
                q.future, part, q.outputs, start_ns - q.enqueued_ns, input_ns, infer_ns, output_ns
            )

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        """A scheduler that died of a bug must not strand its callers."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("model '%s': sequence scheduler failed", self.model, exc_info=task.exception())
        self._accepting = False
        self._fail_queued(internal(f"model '{self.model}' scheduler failed"))

    def _fail_queued(self, error: ApplianceError) -> None:
        for seq in self._slots.all():
            for q in seq.queue:
                if not q.future.done():
                    q.future.set_exception(error)
            seq.queue.clear()
        self._count(-self._queued)

    def release_memory(self) -> Awaitable[Any]:
        """Each instance hands back the working memory its engine keeps, on its own
        thread after the batch it runs now, if any
        (:func:`appliance.core.memory.hand_back`)."""
        runs = (i.run(memory.hand_back) for i in self._instances)
        return asyncio.gather(*runs, return_exceptions=True)

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting, drain queued and running work for up to ``timeout_s``,
        then fail whatever is left with UNAVAILABLE and cancel the scheduler."""
        self._accepting = False
        self._wake.set()
        unloaded = unavailable(
            f"model '{self.model}' was unloaded before the request ran", FailureReason.REJECTED
        )
        await wind_down(
            self._scheduler, self._running, timeout_s, lambda: self._fail_queued(unloaded)
        )
