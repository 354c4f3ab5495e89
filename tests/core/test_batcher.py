"""The batching decision (pure) and the DynamicBatcher driving fake backends.

Every wait is bounded: the event-loop side with ``asyncio.wait_for``, the worker
side with ``threading.Event.wait(timeout)``, so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from appliance.backends.base import TensorSpec
from appliance.core.batcher import DynamicBatcher
from appliance.core.batching import (
    INLINE_BOUND_NS,
    INLINE_WARM,
    BatchPolicy,
    BatchResult,
    Decision,
    InlineCost,
    catch_up,
    decide,
    next_batch,
    sends_alone,
    wake_rows,
)
from appliance.core.instances import InstanceGroup
from appliance.core.queue_bytes import CONTENDED
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, Code, FailureReason

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 5.0  # upper bound on any single wait; only reached when a test is failing


# ---- decide: pure, no event loop ------------------------------------------------------


@dataclass(frozen=True)
class Item:
    rows: int = 1
    signature: Hashable = "a"
    arrival: float = 0.0


DYNAMIC = BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0, dynamic=True)


def test_decide_empty_queue_sends_nothing_and_waits_for_an_arrival() -> None:
    assert decide([], 5.0, DYNAMIC) == Decision(send=(), wait_s=None)


def test_decide_without_dynamic_batching_sends_one_request_at_a_time() -> None:
    queue = [Item(), Item(), Item()]
    assert decide(queue, 0.0, BatchPolicy(max_batch_size=8, dynamic=False)).send == (0,)
    assert decide(queue, 0.0, BatchPolicy(max_batch_size=0, dynamic=True)).send == (0,)


def test_decide_sends_at_once_when_max_batch_size_rows_are_queued() -> None:
    queue = [Item(arrival=t) for t in (0.0, 0.1, 0.2, 0.3, 0.4)]
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=10.0, dynamic=True)
    assert decide(queue, 0.5, policy) == Decision(send=(0, 1, 2, 3))


def test_decide_waits_for_the_rest_of_the_delay_of_the_oldest_request() -> None:
    queue = [Item(arrival=10.0), Item(arrival=10.5)]
    decision = decide(queue, 10.6, DYNAMIC)
    assert decision.send == ()
    assert decision.wait_s == pytest.approx(0.4)  # 10.0 + 1.0 - 10.6, not from 10.5


def test_decide_sends_everything_compatible_once_the_oldest_delay_expired() -> None:
    queue = [Item(arrival=10.0), Item(arrival=10.9)]
    assert decide(queue, 11.0, DYNAMIC).send == (0, 1)
    assert decide(queue, 12.0, DYNAMIC).send == (0, 1)


def test_decide_merges_multi_row_requests_up_to_max_batch_size() -> None:
    policy = BatchPolicy(max_batch_size=6, max_queue_delay_s=1.0, dynamic=True)
    assert decide([Item(rows=2), Item(rows=3)], 0.0, policy).wait_s == pytest.approx(1.0)
    assert decide([Item(rows=2), Item(rows=3), Item(rows=1)], 0.0, policy).send == (0, 1, 2)


def test_decide_a_request_that_would_overflow_blocks_the_batch_and_keeps_fifo() -> None:
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=10.0, dynamic=True)
    # 2 + 3 > 4: the batch can't grow, so it goes now; the 1-row request that would
    # fit must not jump ahead of the 3-row one
    assert decide([Item(rows=2), Item(rows=3), Item(rows=1)], 0.0, policy) == Decision(send=(0,))


def test_decide_a_request_of_another_shape_ends_the_batch_which_goes_at_once() -> None:
    # Triton's rule: the batch cannot grow past a request of another shape (or other
    # optional inputs), so it is sent as it is instead of waiting out the delay
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=10.0, dynamic=True)
    queue = [Item(signature="a"), Item(signature="b"), Item(signature="a"), Item(signature="b")]
    assert decide(queue, 0.0, policy) == Decision(send=(0,))
    assert decide([Item(), Item(), Item(signature="b"), Item()], 0.0, policy).send == (0, 1)
    # never merged: the next batch leads with the other shape, and ends at the next change
    assert decide(queue[1:], 0.0, policy).send == (0,)
    # alone, one shape waits for the delay as before
    assert decide([Item(), Item()], 0.0, policy).wait_s == pytest.approx(10.0)


def test_decide_preferred_sizes_follow_triton() -> None:
    policy = BatchPolicy(
        max_batch_size=8, preferred_batch_sizes=(2, 4), max_queue_delay_s=10.0, dynamic=True
    )
    # below every preferred size: wait for the rest of the delay
    assert decide([Item()], 0.0, policy).wait_s == pytest.approx(10.0)
    # a preferred size is reachable: send the largest one reached, at once
    assert decide([Item()] * 3, 0.0, policy).send == (0, 1)
    assert decide([Item()] * 5, 0.0, policy).send == (0, 1, 2, 3)
    # more queued than the largest preferred size: capped at it, not at max_batch_size
    assert decide([Item()] * 10, 0.0, policy).send == (0, 1, 2, 3)
    # 1 -> 2 (preferred) -> 5 rows: send the preferred 2
    assert decide([Item(), Item(), Item(rows=3)], 0.0, policy).send == (0, 1)
    # 3 rows can't reach 4 without passing it: send the 3 now
    assert decide([Item(rows=3), Item(rows=2)], 0.0, policy).send == (0,)
    # once the delay expired, everything that fits goes, up to max_batch_size
    assert decide([Item(rows=3)] + [Item()] * 9, 11.0, policy).send == tuple(range(6))


def test_decide_without_delay_sends_what_is_there() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0, dynamic=True)
    assert decide([Item(), Item(rows=2)], 0.0, policy).send == (0, 1)


@pytest.mark.parametrize(
    "policy",
    [
        DYNAMIC,
        BatchPolicy(
            max_batch_size=8, preferred_batch_sizes=(4, 6), max_queue_delay_s=1.0, dynamic=True
        ),
        BatchPolicy(
            max_batch_size=8, preferred_batch_sizes=(3, 16), max_queue_delay_s=1.0, dynamic=True
        ),
        BatchPolicy(
            max_batch_size=4, preferred_batch_sizes=(9,), max_queue_delay_s=1.0, dynamic=True
        ),
    ],
)
def test_below_wake_rows_no_arrival_changes_a_waiting_decision(policy: BatchPolicy) -> None:
    # the batcher wakes an instance that waits out the delay only from wake_rows queued
    # rows on: below that, decide() must still say "wait" whatever the queue holds
    rows = wake_rows(policy)
    assert 1 <= rows <= policy.max_batch_size
    for shapes in ([1] * (rows - 1), [rows - 1], [1, rows - 2] if rows > 2 else [1]):
        queue = [Item(rows=n) for n in shapes if n > 0]
        if queue:
            assert decide(queue, 0.0, policy).send == ()
    # an arrival of another shape changes it (the batcher wakes the instance for it)
    assert decide([Item(), Item(signature="b")], 0.0, policy).send == (0,)
    # and at wake_rows of one shape the decision can change before the delay ran out
    assert decide([Item()] * rows, 0.0, policy).send != ()


def test_catch_up_holds_a_partial_batch_for_the_rest_of_the_delay_only() -> None:
    # answers handed to the loop at t=10.0; DYNAMIC: max_batch_size 8, delay 1 s
    assert catch_up(DYNAMIC, 3, since=10.0, now=10.25) == pytest.approx(0.75)
    assert catch_up(DYNAMIC, 3, since=10.0, now=11.5) == 0.0  # the delay ran out: send
    assert catch_up(DYNAMIC, 8, since=10.0, now=10.25) == 0.0  # full: nothing can join
    assert catch_up(BatchPolicy(max_batch_size=8, dynamic=True), 1, 10.0, 10.0) == 0.0  # no delay
    assert catch_up(BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0), 1, 10.0, 10.0) == 0.0


def test_next_batch_holds_a_partial_batch_for_undelivered_answers_unless_stopping() -> None:
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.5, dynamic=True)
    due = time.monotonic() - 1.0  # arrived long ago: the delay is over
    queue = [Item(1, arrival=due), Item(1, arrival=due)]
    assert next_batch(queue, policy, None, True, 1.0) == ((0, 1), 1.0)
    # the loop has not taken this instance's last answers: held for the rest of the delay
    send, wait_s = next_batch(queue, policy, time.monotonic(), True, 1.0)
    assert send == () and 0 < wait_s <= 0.5
    assert next_batch(queue, policy, time.monotonic(), False, 1.0) == ((0, 1), 1.0)
    fresh = [Item(1, arrival=time.monotonic())]  # within its delay: waits at most the idle check
    send, wait_s = next_batch(fresh, policy, None, True, 0.2)
    assert send == () and 0 < wait_s <= 0.2
    now = time.monotonic()
    full = [Item(2, arrival=now), Item(2, arrival=now)]  # a full batch goes at once
    assert next_batch(full, policy, time.monotonic(), True, 1.0) == ((0, 1), 1.0)
    # stopping: queued requests go as they are, however fresh
    assert next_batch(fresh, policy, None, False, 1.0) == ((0,), 1.0)


def test_wake_rows_follow_the_policy() -> None:
    assert wake_rows(DYNAMIC) == 8  # no preferred size: only a full batch goes early
    prefs = BatchPolicy(
        max_batch_size=8, preferred_batch_sizes=(6, 4), max_queue_delay_s=1.0, dynamic=True
    )
    assert wake_rows(prefs) == 4  # the smallest preferred size
    assert wake_rows(BatchPolicy(max_batch_size=8)) == 1  # not dynamic: every request
    assert wake_rows(BatchPolicy(max_batch_size=0, dynamic=True)) == 1


# ---- DynamicBatcher with fake backends ------------------------------------------------


class Doubler:
    """Returns ``y = 2 x``; records each call's batch and thread; can hold calls.

    While ``release`` is unset, every infer signals ``started`` and blocks on it, so
    a test controls when a batch finishes.
    """

    inputs = [TensorSpec("x", "FP32", (-1, -1))]
    outputs = [TensorSpec("y", "FP32", (-1, -1))]

    def __init__(
        self, hold: bool = False, fail_on_negative: bool = False, omit_outputs: bool = False
    ) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fail_on_negative = fail_on_negative
        self.omit_outputs = omit_outputs
        self.calls: list[np.ndarray] = []  # a copy of each call's x
        self.threads: list[str] = []
        self.closed = 0

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        self.calls.append(inputs["x"].copy())
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if not self.release.wait(LIMIT_S):
            raise RuntimeError("test never released the batch")
        if self.fail_on_negative and (inputs["x"] < 0).any():
            raise ValueError("negative input")
        if self.omit_outputs:
            return {}
        return {"y": inputs["x"] * 2}

    def close(self) -> None:
        self.closed += 1


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 10 * LIMIT_S)

    return asyncio.run(bounded())


async def until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), LIMIT_S)


async def make_batcher(
    backend: Any, policy: BatchPolicy, max_queue_size: int = 16, count: int = 1
) -> tuple[DynamicBatcher, InstanceGroup, ModelStats]:
    group = await InstanceGroup.create("m", count, lambda i: backend)
    stats = ModelStats("m", "1")
    return DynamicBatcher("m:1", group, policy, max_queue_size, stats), group, stats


def x(value: float, rows: int = 1, cols: int = 2) -> np.ndarray:
    return np.full((rows, cols), value, dtype=np.float32)


def submit(
    batcher: DynamicBatcher, arr: np.ndarray, timeout_s: float | None = None
) -> asyncio.Task[BatchResult]:
    return asyncio.get_running_loop().create_task(
        batcher.submit({"x": arr}, ("y",), arr.shape[0], arr.shape[1:], timeout_s)
    )


async def shutdown(batcher: DynamicBatcher, group: InstanceGroup) -> None:
    await batcher.stop(LIMIT_S)
    await group.close()


async def one_running_three_queued(
    backend: Doubler,
) -> tuple[DynamicBatcher, InstanceGroup, ModelStats, list[asyncio.Task[BatchResult]]]:
    """A batcher running one request at a time: x=0 held in the backend, x=1..3 queued."""
    one_at_a_time = BatchPolicy(max_batch_size=8, dynamic=False)
    batcher, group, stats = await make_batcher(backend, one_at_a_time)
    tasks = [submit(batcher, x(0))]
    await until(backend.started.is_set)
    tasks += [submit(batcher, x(v)) for v in (1, 2, 3)]
    await until(lambda: batcher.pending == 3)
    return batcher, group, stats, tasks


MERGE = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0, dynamic=True)


def test_concurrent_requests_are_merged_into_one_call_and_split_back() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, stats = await make_batcher(backend, MERGE)
        first = submit(batcher, x(1))
        await until(backend.started.is_set)  # the instance is busy with `first`
        rest = [
            submit(batcher, x(2, rows=1)),
            submit(batcher, x(3, rows=2)),
            submit(batcher, x(4, rows=1)),
        ]
        await until(lambda: batcher.pending == 3)
        assert stats.pending == 3
        backend.release.set()
        results = await asyncio.gather(first, *rest)
        for value, rows, result in zip((1, 2, 3, 4), (1, 1, 2, 1), results, strict=True):
            np.testing.assert_array_equal(result.outputs["y"], x(2 * value, rows))
        assert [c.shape[0] for c in backend.calls] == [1, 4]
        np.testing.assert_array_equal(backend.calls[1][:, 0], [2, 3, 3, 4])  # FIFO order
        assert stats.execution_count == 2
        assert stats.inference_count == 5
        assert stats.execution_count < stats.inference_count
        assert sorted(stats.batches) == [1, 4]
        assert stats.pending == 0
        await shutdown(batcher, group)

    run(main())


def test_an_instance_takes_its_next_batch_without_the_event_loop() -> None:
    """Each instance's thread is its own scheduler (Triton's model): queued requests
    run back to back even while the event loop is busy with something else."""
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, stats, tasks = await one_running_three_queued(backend)
        backend.release.set()
        # the loop is blocked from here on: only the instance's thread can make progress
        ran_all = threading.Event()
        for _ in range(int(LIMIT_S / 0.01)):
            if len(backend.calls) == 4:
                ran_all.set()
                break
            threading.Event().wait(0.01)
        assert ran_all.is_set(), [c[0, 0] for c in backend.calls]
        assert [c[0, 0] for c in backend.calls] == [0, 1, 2, 3]
        results = await asyncio.gather(*tasks)  # delivered once the loop runs again
        assert [r.outputs["y"][0, 0] for r in results] == [0, 2, 4, 6]
        assert stats.execution_count == 4
        await shutdown(batcher, group)

    run(main())


def test_a_full_batch_is_sent_without_waiting_for_the_queue_delay() -> None:
    backend = Doubler()
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=30.0, dynamic=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, policy)
        tasks = [submit(batcher, x(v)) for v in range(4)]
        # far below the 30 s delay: only "batch is full" can release these
        results = await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)
        assert [r.outputs["y"][0, 0] for r in results] == [0, 2, 4, 6]
        assert [c.shape[0] for c in backend.calls] == [4]
        await shutdown(batcher, group)

    run(main())


def test_a_partial_batch_is_sent_when_the_oldest_request_waited_the_queue_delay() -> None:
    backend = Doubler()
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.05, dynamic=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, policy)
        results = await asyncio.gather(submit(batcher, x(1)), submit(batcher, x(2)))
        assert [r.outputs["y"][0, 0] for r in results] == [2, 4]
        assert [c.shape[0] for c in backend.calls] == [2]
        await shutdown(batcher, group)

    run(main())


def test_requests_with_different_non_batch_shapes_never_share_a_call() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, MERGE)
        first = submit(batcher, x(0, cols=2))
        await until(backend.started.is_set)
        rest = [submit(batcher, x(v, cols=c)) for v, c in ((1, 2), (2, 3), (3, 2), (4, 3))]
        await until(lambda: batcher.pending == 4)
        backend.release.set()
        results = await asyncio.gather(first, *rest)
        for (value, cols), result in zip(
            ((0, 2), (1, 2), (2, 3), (3, 2), (4, 3)), results, strict=True
        ):
            np.testing.assert_array_equal(result.outputs["y"], x(2 * value, cols=cols))
        # each change of shape ends a batch (Triton's): queue order, nothing merged
        assert [c.shape for c in backend.calls] == [(1, 2), (1, 2), (1, 3), (1, 2), (1, 3)]
        assert [int(c[0, 0]) for c in backend.calls] == [0, 1, 2, 3, 4]
        await shutdown(batcher, group)

    run(main())


def test_a_full_queue_rejects_at_once_with_unavailable() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, MERGE, max_queue_size=2)
        running = submit(batcher, x(0))
        await until(backend.started.is_set)
        queued = [submit(batcher, x(1)), submit(batcher, x(2))]
        await until(lambda: batcher.pending == 2)
        with pytest.raises(ApplianceError) as info:
            await batcher.submit({"x": x(3)}, ("y",), 1, (2,), None)  # no waiting involved
        assert info.value.code is Code.UNAVAILABLE
        assert info.value.reason is FailureReason.REJECTED
        assert info.value.message == "Exceeds maximum queue size"  # Triton's text
        assert batcher.pending == 2
        backend.release.set()
        results = await asyncio.gather(running, *queued)
        assert [r.outputs["y"][0, 0] for r in results] == [0, 2, 4]
        assert all((c != 3).all() for c in backend.calls)  # the rejected one never ran
        await shutdown(batcher, group)

    run(main())


def test_a_request_that_cannot_be_served_in_time_gets_a_timeout_error() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, stats = await make_batcher(backend, MERGE)
        running = submit(batcher, x(0))
        await until(backend.started.is_set)
        with pytest.raises(ApplianceError) as info:
            await submit(batcher, x(7), timeout_s=0.05)
        assert info.value.code is Code.UNAVAILABLE
        assert info.value.reason is FailureReason.REJECTED
        assert info.value.message == "Request timeout expired"  # Triton's text
        assert batcher.pending == 0
        assert stats.pending == 0
        backend.release.set()
        assert (await running).outputs["y"][0, 0] == 0
        ok = await submit(batcher, x(5), timeout_s=LIMIT_S)  # a generous timeout still works
        assert ok.outputs["y"][0, 0] == 10
        assert all((c != 7).all() for c in backend.calls)
        await shutdown(batcher, group)

    run(main())


def test_a_backend_error_fails_only_its_batch() -> None:
    backend = Doubler(hold=True, fail_on_negative=True)

    async def main() -> None:
        batcher, group, stats = await make_batcher(backend, MERGE)
        held = submit(batcher, x(1))
        await until(backend.started.is_set)
        doomed = [submit(batcher, x(-1)), submit(batcher, x(2))]  # one batch with a bad row
        await until(lambda: batcher.pending == 2)
        backend.release.set()
        assert (await held).outputs["y"][0, 0] == 2
        for task in doomed:
            with pytest.raises(ApplianceError) as info:
                await task
            assert info.value.code is Code.INTERNAL
            assert info.value.reason is FailureReason.BACKEND
            assert "negative input" in info.value.message
        after = await submit(batcher, x(3))
        assert after.outputs["y"][0, 0] == 6
        assert stats.execution_count == 2  # failed executions aren't counted
        await shutdown(batcher, group)

    run(main())


def test_a_backend_that_omits_a_requested_output_answers_without_it_instead_of_hanging() -> None:
    # Triton's: a model (a Python model's response) may leave an output out
    backend = Doubler(omit_outputs=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, MERGE)
        answered = await asyncio.wait_for(submit(batcher, x(1)), LIMIT_S)
        assert "y" not in answered.outputs
        await shutdown(batcher, group)

    run(main())


def test_a_cancelled_caller_is_dropped_from_the_queue_and_others_are_unaffected() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, stats = await make_batcher(backend, MERGE)
        running = submit(batcher, x(1))
        await until(backend.started.is_set)
        gone, kept = submit(batcher, x(2)), submit(batcher, x(3))
        await until(lambda: batcher.pending == 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert batcher.pending == 1
        assert stats.pending == 1
        running.cancel()  # already executing: its result is dropped, the batch runs on
        with pytest.raises(asyncio.CancelledError):
            await running
        backend.release.set()
        assert (await kept).outputs["y"][0, 0] == 6
        assert all((c != 2).all() for c in backend.calls)  # the queued one never ran
        assert [c[0, 0] for c in backend.calls] == [1, 3]
        assert (await submit(batcher, x(4))).outputs["y"][0, 0] == 8
        await shutdown(batcher, group)

    run(main())


def test_stop_drains_queued_work_then_refuses_new_requests() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, stats, tasks = await one_running_three_queued(backend)
        stopping = asyncio.get_running_loop().create_task(batcher.stop(LIMIT_S))
        await asyncio.sleep(0)
        with pytest.raises(ApplianceError) as info:
            await batcher.submit({"x": x(9)}, ("y",), 1, (2,), None)
        assert info.value.code is Code.UNAVAILABLE
        backend.release.set()
        await stopping
        # stop() returns only once every queued request has been answered, including
        # those whose batches were dispatched while it was draining
        assert all(t.done() for t in tasks)
        assert [t.result().outputs["y"][0, 0] for t in tasks] == [0, 2, 4, 6]
        assert stats.execution_count == 4
        assert batcher.pending == 0
        with pytest.raises(ApplianceError) as info:
            await batcher.submit({"x": x(9)}, ("y",), 1, (2,), None)
        assert info.value.code is Code.UNAVAILABLE
        assert all((c != 9).all() for c in backend.calls)
        await group.close()

    run(main())


def test_stop_fails_what_it_could_not_drain_in_time() -> None:
    backend = Doubler(hold=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, MERGE)
        running = submit(batcher, x(0))
        await until(backend.started.is_set)
        queued = submit(batcher, x(1))
        await until(lambda: batcher.pending == 1)
        await batcher.stop(0.05)  # the held batch can't finish in time
        for task in (running, queued):
            assert task.done()
            with pytest.raises(ApplianceError) as info:
                task.result()
            assert info.value.code is Code.UNAVAILABLE
            assert "unloaded" in info.value.message
        assert batcher.pending == 0
        backend.release.set()  # let the worker thread finish before closing
        await group.close()
        assert backend.closed == 1
        assert [c[0, 0] for c in backend.calls] == [0]

    run(main())


def test_a_batcher_never_stopped_does_not_hold_the_interpreter_at_exit() -> None:
    """The instance threads wait for work; a batcher nobody stopped (its loop closed
    without an unload) must not keep the process from exiting."""
    script = textwrap.dedent(
        """
        import asyncio
        import numpy as np
        from appliance.core.batcher import DynamicBatcher
        from appliance.core.batching import BatchPolicy
        from appliance.core.instances import InstanceGroup
        from appliance.core.stats import ModelStats

        class Echo:
            def infer(self, inputs, outputs):
                return {"y": inputs["x"]}

            def close(self):
                pass

        async def main():
            group = await InstanceGroup.create("m", 2, lambda i: Echo())
            policy = BatchPolicy(max_batch_size=8, dynamic=True)
            batcher = DynamicBatcher("m:1", group, policy, 4, ModelStats("m", "1"))
            x = np.ones((1, 2), np.float32)
            result = await batcher.submit({"x": x}, ("y",), 1, (2,), None)
            print("answered", result.outputs["y"].tolist())  # and no stop()

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "answered [[1.0, 1.0]]" in done.stdout


def test_priority_levels_serve_the_urgent_first_and_keep_arrival_order_within_a_level() -> None:
    # an alarm camera (level 1) ahead of a counting one (level 2, the default)
    backend = Doubler(hold=True)
    policy = BatchPolicy(
        max_batch_size=8, dynamic=False, priority_levels=2, default_priority_level=2
    )
    assert [policy.level(p) for p in (0, 1, 2, 3)] == [2, 1, 2, 2]  # 0, out of range: default

    async def main() -> None:
        batcher, group, _ = await make_batcher(backend, policy)
        loop = asyncio.get_running_loop()

        def ask(value: float, level: int) -> asyncio.Task[BatchResult]:
            arr = x(value)
            return loop.create_task(
                batcher.submit({"x": arr}, ("y",), 1, arr.shape[1:], None, level)
            )

        held = ask(0, 2)
        await until(backend.started.is_set)
        queued = [ask(1, 2), ask(2, 2), ask(3, 1), ask(4, 2), ask(5, 1)]
        await until(lambda: batcher.pending == 5)
        backend.release.set()
        await asyncio.gather(held, *queued)
        assert [int(c[0, 0]) for c in backend.calls] == [0, 3, 5, 1, 2, 4]
        await shutdown(batcher, group)

    run(main())


# ---- handing back working memory after a burst ------------------------------------------


class Releasing(Doubler):
    """A Doubler whose engine can hand back working memory; records on which thread,
    and after which calls."""

    def __init__(self, hold: bool = False) -> None:
        super().__init__(hold=hold)
        self.released: list[tuple[str, int]] = []  # (thread, calls made before it)

    def release_memory(self) -> None:
        self.released.append((threading.current_thread().name, len(self.calls)))


def test_each_instance_hands_back_memory_on_its_own_thread_after_the_queue_is_done() -> None:
    async def main() -> None:
        backend = Releasing(hold=True)
        batcher, group, _, tasks = await one_running_three_queued(backend)
        released = batcher.release_memory()  # asked while one runs and three wait
        await asyncio.sleep(0.05)
        assert backend.released == []  # not between queued requests
        backend.release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)
        await asyncio.wait_for(released, LIMIT_S)
        assert backend.released == [(backend.threads[0], 4)]  # the instance's thread, after all
        again = batcher.release_memory()
        assert again is not released  # a new round
        assert batcher.release_memory() is again  # one asked while a round is under way joins it
        await asyncio.wait_for(again, LIMIT_S)
        assert len(backend.released) == 2
        await shutdown(batcher, group)

    run(main())


def test_two_instances_both_hand_back_and_a_stopped_batcher_answers_at_once() -> None:
    async def main() -> None:
        backend = Releasing()
        batcher, group, _ = await make_batcher(backend, MERGE, count=2)
        await asyncio.wait_for(batcher.release_memory(), LIMIT_S)
        assert sorted(t for t, _ in backend.released) == ["m#0_0", "m#1_0"]
        await shutdown(batcher, group)
        done = batcher.release_memory()
        assert done.done()  # nothing waits on a batcher that serves no more
        assert len(backend.released) == 2

    run(main())


# ---- a cheap lone request runs on the event loop ----------------------------------------


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("delay", [0.0, 0.001])
@pytest.mark.parametrize("preferred", [(), (2,), (4, 8)])
def test_sends_alone_is_what_decide_does_with_a_lone_request(
    dynamic: bool, delay: float, preferred: tuple[int, ...]
) -> None:
    policy = BatchPolicy(8, preferred, delay, dynamic)
    for rows in range(1, 9):
        at_once = bool(decide([Item(rows=rows, arrival=5.0)], 5.0, policy).send)
        assert sends_alone(policy, rows) == at_once, (policy, rows)


def test_inline_cost_warms_up_then_turns_off_after_a_slow_run_and_back_on() -> None:
    cost = InlineCost()
    for _ in range(INLINE_WARM - 1):
        cost.record(1_000, inline=False)
    assert not cost.cheap()  # the first requests after a load go to the thread
    cost.record(1_000, inline=False)
    assert cost.cheap()
    cost.record(5 * INLINE_BOUND_NS, inline=True)  # one inline run far over the bound
    assert not cost.cheap()
    runs = 0
    while not cost.cheap():
        cost.record(1_000, inline=False)
        runs += 1
    assert 5 <= runs <= 10  # a few runs on the thread bring it back


def test_an_inline_run_slow_only_because_its_thread_lost_the_cpu_keeps_inline_on() -> None:
    cost = InlineCost()
    for _ in range(INLINE_WARM):
        cost.record(10_000, inline=False)
    # 5x the bound of wall time, of which the loop's thread spent 12 us on the CPU:
    # preempted on a busy machine, not a slow model
    cost.record(5 * INLINE_BOUND_NS, inline=True, cpu_ns=12_000)
    assert cost.cheap()
    assert cost.mean_ns < 2 * 10_000
    # the same wall time with the CPU spent on it: the model is slow, inline turns off
    cost.record(5 * INLINE_BOUND_NS, inline=True, cpu_ns=5 * INLINE_BOUND_NS)
    assert not cost.cheap()


class InlineDoubler(Doubler):
    inline_safe = True


def test_a_cheap_lone_request_runs_on_the_loop_once_its_model_is_measured_cheap() -> None:
    async def main() -> None:
        backend = InlineDoubler()
        no_delay = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0, dynamic=True)
        batcher, group, stats = await make_batcher(backend, no_delay)
        for v in range(INLINE_WARM):  # measured on the instance's thread first
            result = await asyncio.wait_for(submit(batcher, x(v)), LIMIT_S)
            np.testing.assert_array_equal(result.outputs["y"], x(2 * v))
        assert set(backend.threads) == {"m#0_0"}
        loop_thread = threading.current_thread().name
        result = await asyncio.wait_for(submit(batcher, x(21)), LIMIT_S)
        np.testing.assert_array_equal(result.outputs["y"], x(42))
        assert backend.threads[-1] == loop_thread  # no hand-off either way
        assert stats.execution_count == INLINE_WARM + 1
        await shutdown(batcher, group)

    run(main())


def test_no_inline_run_for_an_engine_that_is_not_inline_safe() -> None:
    async def main() -> None:
        delayed = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.001, dynamic=True)
        for policy in (delayed, MERGE):
            backend = Doubler()
            batcher, group, _ = await make_batcher(backend, policy)
            for v in range(INLINE_WARM + 4):
                await asyncio.wait_for(submit(batcher, x(v)), LIMIT_S)
            assert set(backend.threads) == {"m#0_0"}, policy
            await shutdown(batcher, group)

    run(main())


def test_a_request_finding_its_instance_busy_queues_behind_the_batch_it_runs() -> None:
    async def main() -> None:
        backend = InlineDoubler(hold=False)
        # one row waits out the delay (on the thread); two rows are a preferred size,
        # which a lone request reaches at once (inline when the instance is idle)
        policy = BatchPolicy(8, (2,), 0.001, True)
        batcher, group, _ = await make_batcher(backend, policy)
        for v in range(INLINE_WARM):
            await asyncio.wait_for(submit(batcher, x(v)), LIMIT_S)
        await asyncio.wait_for(submit(batcher, x(3, rows=2)), LIMIT_S)
        assert backend.threads[-1] == threading.current_thread().name  # idle: inline
        backend.release.clear()
        backend.started.clear()
        held = submit_contended(batcher, x(1))  # runs on the thread, held there
        await until(backend.started.is_set)
        behind = submit(batcher, x(5, rows=2))
        await until(lambda: batcher.pending == 1)  # queued, not run on the loop
        backend.release.set()
        results = await asyncio.wait_for(asyncio.gather(held, behind), LIMIT_S)
        np.testing.assert_array_equal(results[1].outputs["y"], x(10, rows=2))
        assert backend.threads[-2:] == ["m#0_0", "m#0_0"]
        await shutdown(batcher, group)

    run(main())


def submit_contended(batcher: DynamicBatcher, arr: np.ndarray) -> asyncio.Task[BatchResult]:
    """:func:`submit` with other requests in flight (the data plane's word)."""

    async def contended() -> BatchResult:
        CONTENDED.set(True)  # (the task's own context: the test's is left as it is)
        return await batcher.submit({"x": arr}, ("y",), arr.shape[0], arr.shape[1:], None)

    return asyncio.get_running_loop().create_task(contended())


def test_a_request_while_others_are_in_flight_goes_to_the_thread_to_batch_with_them() -> None:
    async def main() -> None:
        backend = InlineDoubler()
        batcher, group, _ = await make_batcher(backend, MERGE)
        for v in range(INLINE_WARM):
            await asyncio.wait_for(submit(batcher, x(v)), LIMIT_S)

        result = await asyncio.wait_for(submit_contended(batcher, x(4)), LIMIT_S)
        np.testing.assert_array_equal(result.outputs["y"], x(8))
        assert set(backend.threads) == {"m#0_0"}
        await asyncio.wait_for(submit(batcher, x(1)), LIMIT_S)  # alone again: inline
        assert backend.threads[-1] == threading.current_thread().name
        await shutdown(batcher, group)

    run(main())


class CountingCondition(threading.Condition):
    """A condition that counts its wake-ups of waiting threads."""

    def __init__(self, lock: Any = None) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_a_lone_request_wakes_its_instance_once_not_again_when_its_answer_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The arrival wakes the idle instance; the loop taking the answer with nothing
    queued does not (no batch is held for it): a context switch a request saved."""
    import appliance.core.batcher as batcher_module

    counting = type("threading", (), {"Condition": CountingCondition, "Lock": threading.Lock})
    monkeypatch.setattr(batcher_module, "threading", counting)
    delayed = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.001, dynamic=True)

    async def main() -> None:
        batcher, group, _ = await make_batcher(Doubler(), delayed)
        ready = batcher._ready
        assert isinstance(ready, CountingCondition)
        for value in (1, 2, 3):
            result = await asyncio.wait_for(submit(batcher, x(value)), LIMIT_S)
            np.testing.assert_array_equal(result.outputs["y"], x(2 * value))
        assert ready.notified == 3  # one a request: its arrival
        await shutdown(batcher, group)

    run(main())


# ---- a cheap lone request waiting out the queue delay on the loop ---------------------

# a lone row waits out the delay; two rows (a preferred size) are sent at once
HELD = BatchPolicy(8, (2,), 0.05, True)


async def warm_cheap(
    policy: BatchPolicy = HELD, max_queue_size: int = 16
) -> tuple[InlineDoubler, DynamicBatcher, InstanceGroup, ModelStats]:
    """A batcher whose inline-safe engine is measured cheap (its first runs on the
    instance's thread: each alone, contended, of a preferred size so none waits)."""
    backend = InlineDoubler()
    batcher, group, stats = await make_batcher(backend, policy, max_queue_size)
    for v in range(INLINE_WARM):
        await asyncio.wait_for(submit_contended(batcher, x(v, rows=2)), LIMIT_S)
    assert set(backend.threads) == {"m#0_0"}
    return backend, batcher, group, stats


def test_a_cheap_lone_request_waits_out_the_queue_delay_on_the_loop_then_runs_there() -> None:
    async def main() -> None:
        backend, batcher, group, stats = await warm_cheap()
        calls = len(backend.calls)
        task = submit(batcher, x(3))
        await asyncio.sleep(0)
        assert batcher.pending == 1 and stats.pending == 1  # held: counted as queued
        assert len(backend.calls) == calls  # not run before its delay
        result = await asyncio.wait_for(task, LIMIT_S)
        np.testing.assert_array_equal(result.outputs["y"], x(6))
        assert backend.threads[-1] == threading.current_thread().name  # on the loop
        assert result.queue_ns >= HELD.max_queue_delay_s * 1e9  # it waited the delay out
        assert batcher.pending == 0 and stats.pending == 0
        assert stats.execution_count == INLINE_WARM + 1
        await shutdown(batcher, group)

    run(main())


def test_an_arrival_during_the_hold_batches_with_the_held_request_on_the_thread() -> None:
    async def main() -> None:
        backend, batcher, group, stats = await warm_cheap()
        first = submit(batcher, x(1))
        await asyncio.sleep(0)  # held on the loop
        second = submit(batcher, x(2))
        results = await asyncio.wait_for(asyncio.gather(first, second), LIMIT_S)
        np.testing.assert_array_equal(results[0].outputs["y"], x(2))
        np.testing.assert_array_equal(results[1].outputs["y"], x(4))
        np.testing.assert_array_equal(backend.calls[-1], np.concatenate([x(1), x(2)]))
        assert backend.threads[-1] == "m#0_0"  # one batch of two, on the instance
        assert stats.execution_count == INLINE_WARM + 1
        await shutdown(batcher, group)

    run(main())


def test_a_held_request_cancelled_or_timed_out_is_dropped_and_the_next_one_runs() -> None:
    async def main() -> None:
        backend, batcher, group, _ = await warm_cheap()
        calls = len(backend.calls)
        cancelled = submit(batcher, x(1))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert batcher.pending == 0
        late = submit(batcher, x(2), timeout_s=0.001)  # a timeout inside the delay
        with pytest.raises(ApplianceError, match="timeout") as info:
            await asyncio.wait_for(late, LIMIT_S)
        assert info.value.code == Code.UNAVAILABLE
        assert len(backend.calls) == calls  # neither ran
        result = await asyncio.wait_for(submit(batcher, x(5)), LIMIT_S)
        np.testing.assert_array_equal(result.outputs["y"], x(10))
        assert backend.threads[-1] == threading.current_thread().name
        await shutdown(batcher, group)

    run(main())


def test_a_held_request_counts_against_the_queue_bound() -> None:
    async def main() -> None:
        backend, batcher, group, _ = await warm_cheap(max_queue_size=1)
        held = submit(batcher, x(1))
        await asyncio.sleep(0)
        assert batcher.pending == 1
        with pytest.raises(ApplianceError) as info:  # the one place is taken
            await asyncio.wait_for(submit(batcher, x(2)), LIMIT_S)
        assert info.value.code == Code.UNAVAILABLE
        assert batcher.pending == 1
        result = await asyncio.wait_for(held, LIMIT_S)  # served from the queue
        np.testing.assert_array_equal(result.outputs["y"], x(2))
        assert backend.threads[-1] == "m#0_0"
        await shutdown(batcher, group)

    run(main())


def test_stopping_drains_a_held_request_and_refuses_the_next() -> None:
    async def main() -> None:
        backend, batcher, group, _ = await warm_cheap(BatchPolicy(8, (2,), LIMIT_S, True))
        held = submit(batcher, x(4))
        await asyncio.sleep(0)
        assert batcher.pending == 1
        await batcher.stop(LIMIT_S)  # answered well before its delay of LIMIT_S
        result = await asyncio.wait_for(held, LIMIT_S)
        np.testing.assert_array_equal(result.outputs["y"], x(8))
        assert backend.threads[-1] == "m#0_0"  # drained by the instance
        with pytest.raises(ApplianceError, match="unloading"):
            await submit(batcher, x(1))
        await group.close()

    run(main())
