"""Batching, the parts every scheduler shares: the dynamic-batching decision, one
execution of a batch on an instance's thread, and the stop both batchers share.

The decision is the pure function :func:`decide` (queue view + monotonic now ->
send these requests now, or wait N seconds), as Triton's DynamicBatchScheduler
does. A batch is formed from decoded tensors (gathered on the instance's thread,
never on the event loop) and results are split back by each request's row count
as views (:func:`run_batch`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from appliance.backends.base import Backend
from appliance.decoupled import CancelFlag, RequestInputs, cancel_of
from appliance.errors import ApplianceError, FailureReason, internal

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
    # Triton's priority levels (1 first); 0: one queue in arrival order
    priority_levels: int = 0
    default_priority_level: int = 0

    def level(self, priority: int) -> int:
        """The queue level of a request's ``priority`` (0 or out of range: the default)."""
        if not self.priority_levels:
            return 0
        return priority if 1 <= priority <= self.priority_levels else self.default_priority_level


@dataclass(frozen=True, slots=True)
class Decision:
    """``send``: queue positions to execute now (empty: nothing yet).
    ``wait_s``: when nothing is sent, how long until the decision may change
    without a new arrival (None: only a new arrival can change it)."""

    send: tuple[int, ...] = ()
    wait_s: float | None = None


def decide(queue: Iterable[Queued], now: float, policy: BatchPolicy) -> Decision:
    """Pick the next batch from ``queue`` (oldest first) at monotonic time ``now``.

    Triton's dynamic-batcher rules (``DynamicBatchScheduler::GetDynamicBatch``). The
    oldest request leads, and the requests behind it join in queue order while their
    rows fit under max_batch_size and their non-batch shapes (and the optional inputs
    they give: the ``signature``) match the batch's. The first request that does not
    fit, or has another shape, ends the batch: it cannot grow, so it is not held for
    the delay (Triton sends "the pending batch as it is"). Then, in order:

    1. If the batch reached a preferred size (or can't reach the largest preferred
       size without passing it) and the oldest request's delay has not expired,
       send the largest such batch now.
    2. Send everything picked if the batch is full or can't grow (the next request
       doesn't fit or has another shape), reached the largest preferred size, the
       delay expired, or there is no delay.
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
        if rows + item.rows > largest_preferred and not best:
            best = len(picked)  # growing further passes every preferred size
        if rows + item.rows > limit or item.signature != head.signature:
            blocked = True  # FIFO: later requests don't jump ahead of this one
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


def sends_alone(policy: BatchPolicy, rows: int) -> bool:
    """Whether :func:`decide` sends a lone request of ``rows`` rows the moment it
    arrives (no batching, no queue delay, or a preferred or the largest size alone)."""
    limit = policy.max_batch_size
    if not policy.dynamic or limit <= 0 or policy.max_queue_delay_s <= 0:
        return True
    preferred = policy.preferred_batch_sizes
    largest = min(max(preferred), limit) if preferred else limit
    return rows in preferred or rows >= largest


# a run the event loop may take in place of two thread hand-offs (of the order of what
# the offload rule lets it spend decoding a small payload)
INLINE_BOUND_NS = 100_000
INLINE_WARM = 8  # one-request executions on the instance's thread before any inline run


class InlineCost:
    """Whether a model's lone requests are cheap enough to run on the event loop: a
    moving mean of its one-request executions under :data:`INLINE_BOUND_NS`, after
    :data:`INLINE_WARM` of them. An inline run over four times the bound sets the mean
    to it, which turns inline runs off until runs on the thread bring it back under.

    An inline run's time is its wall time, unless that is over four times the bound
    and the loop's thread spent under the bound of CPU on it (``cpu_ns``): then the
    thread was preempted or waited (a busy machine), which says nothing of the model,
    and the CPU time is what counts. A model that does take long keeps the loop's
    thread busy that long, so it is still caught at its first run."""

    __slots__ = ("mean_ns", "samples")

    def __init__(self) -> None:
        self.mean_ns = 0.0
        self.samples = 0

    def cheap(self) -> bool:
        return self.samples >= INLINE_WARM and self.mean_ns < INLINE_BOUND_NS

    def record(self, ns: int, inline: bool, cpu_ns: int | None = None) -> None:
        if inline and ns > 4 * INLINE_BOUND_NS:
            if cpu_ns is None or cpu_ns >= INLINE_BOUND_NS:
                self.mean_ns = float(ns)
                self.samples += 1
                return
            ns = cpu_ns  # preempted, not slow
        if self.samples:
            self.mean_ns += 0.2 * (ns - self.mean_ns)
        else:
            self.mean_ns = float(ns)
        self.samples += 1


def wake_rows(policy: BatchPolicy) -> int:
    """The queued rows (of any shape) from which an arrival can change the decision of
    an instance waiting out the oldest request's delay.

    Before the delay runs out, :func:`decide` sends only a batch that is full, blocked
    by a request that does not fit, or at a preferred size; each needs at least this
    many rows queued. Below it an arrival leaves a waiting instance asleep until the
    delay runs out (or an arrival reaches it): one wake-up per batch instead of one per
    request, each of which costs the waking thread the GIL. An arrival into an empty
    queue always wakes an idle instance (it starts the delay).
    """
    if not policy.dynamic or policy.max_batch_size <= 0:
        return 1  # every request is a batch of its own
    limit = policy.max_batch_size
    reachable = [size for size in policy.preferred_batch_sizes if 0 < size <= limit]
    return min(reachable) if reachable else limit


def catch_up(policy: BatchPolicy, rows: int, since: float, now: float) -> float:
    """How long an instance holds a batch of ``rows`` that :func:`decide` would send,
    while the event loop has not yet taken the answers the instance handed it at
    monotonic time ``since``: the rest of the queue delay from then (0: send now).

    A loop with answers to hand out has requests to read too: a batch taken the moment
    the instance is idle leaves those for the next one, a whole execution later (under
    load, small batches back to back while the loop falls behind). Holding it until the
    loop took the answers (it wakes the instance then), within the delay the config
    grants for fuller batches, lets them in. A full batch, or no delay, goes at once.
    """
    delay = policy.max_queue_delay_s
    if delay <= 0 or not policy.dynamic or rows >= policy.max_batch_size:
        return 0.0
    return max(0.0, since + delay - now)


def next_batch(
    queue: Sequence[Queued],
    policy: BatchPolicy,
    undelivered_since: float | None,
    accepting: bool,
    idle_s: float,
) -> tuple[tuple[int, ...], float]:
    """What an idle instance does with the (non-empty) ``queue``: the positions of the
    batch it sends now (empty: none yet), and how long it waits otherwise (at most
    ``idle_s``). :func:`decide`, then :func:`catch_up` while the loop has not taken
    this instance's last answers (handed over at monotonic ``undelivered_since``).
    Once the batcher stops ``accepting``, waiting for fuller batches only delays the
    drain: what is queued goes as it is."""
    now = time.monotonic()
    decision = decide(queue, now if accepting else math.inf, policy)
    if not decision.send:
        return (), idle_s if decision.wait_s is None else min(idle_s, decision.wait_s)
    if undelivered_since is None or not accepting:
        return decision.send, idle_s
    rows = sum(queue[i].rows for i in decision.send)
    hold_s = catch_up(policy, rows, undelivered_since, now)
    return (decision.send, idle_s) if hold_s <= 0 else ((), min(idle_s, hold_s))


@dataclass(slots=True)
class BatchResult:
    """What one request gets back: its slice of the outputs and the batch timings."""

    outputs: dict[str, np.ndarray]
    queue_ns: int
    input_ns: int
    infer_ns: int
    output_ns: int


def failed_batch(model: str, exc: Exception) -> ApplianceError:
    """What every caller of a failed batch gets: an :class:`ApplianceError` as raised;
    anything else (an engine error, which fails this batch only) logged and turned
    into INTERNAL naming the model."""
    if isinstance(exc, ApplianceError):
        return exc
    log.error("model '%s': inference failed", model, exc_info=exc)
    return internal(f"model '{model}' failed to run: {exc}", FailureReason.BACKEND)


def answer(
    future: asyncio.Future[BatchResult],
    part: dict[str, np.ndarray],
    outputs: tuple[str, ...],
    queue_ns: int,
    input_ns: int,
    infer_ns: int,
    output_ns: int,
) -> None:
    """Resolve one caller's future with the outputs it asked for from its rows of the
    batch, unless the caller went away."""
    if not future.done():
        future.set_result(
            # an output the model did not return is left out of the answer (Triton's:
            # a Python model may answer a request without some of its outputs)
            BatchResult(
                {k: part[k] for k in outputs if k in part}, queue_ns, input_ns, infer_ns, output_ns
            )
        )


# what a batch came to: (parts, input_ns, infer_ns, output_ns), or the error it raised
Outcome = tuple[list[dict[str, np.ndarray]], int, int, int] | Exception


def attempt_batch(
    backend: Backend,
    items: list[dict[str, np.ndarray]],
    rows: list[int],
    outputs: list[str],
    batched: bool,
) -> Outcome:
    """:func:`run_batch`, with the error it raises as its outcome (an instance's
    thread delivers it as that batch's error and goes on)."""
    try:
        return run_batch(backend, items, rows, outputs, batched)
    except Exception as exc:
        return exc


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
        if isinstance(items[0], RequestInputs):  # requests with equal parameters
            flags = [f for it in items if (f := cancel_of(it)) is not None]
            batch = RequestInputs(batch, None, items[0].parameters, CancelFlag.all_of(flags))
    t1 = time.perf_counter_ns()
    result = backend.infer(batch, outputs)
    t2 = time.perf_counter_ns()
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


def run_alone(
    model: str,
    backend: Backend,
    inputs: dict[str, np.ndarray],
    outputs: tuple[str, ...],
    rows: int,
    batched: bool,
) -> BatchResult:
    """One request on ``backend``, on the calling thread (no queue): its answer, or
    the error its callers get (:func:`failed_batch`)."""
    try:
        parts, input_ns, infer_ns, output_ns = run_batch(
            backend, [inputs], [rows], list(outputs), batched
        )
    except Exception as exc:
        raise failed_batch(model, exc) from None
    part = parts[0]
    return BatchResult({k: part[k] for k in outputs if k in part}, 0, input_ns, infer_ns, output_ns)


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
