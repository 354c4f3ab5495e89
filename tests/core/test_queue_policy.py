"""Dynamic batching's queue policies (Triton's ``default_queue_policy`` and
``priority_queue_policy``): the queue's order and bounds alone, then the batcher with a
clock the test drives (a request's timeout fires when the test says so, never on a
timing margin)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from appliance.config.model_config import DynamicBatching, parse_model_config
from appliance.config.scheduling_config import QueuePolicy
from appliance.core.batch_queue import BatchQueue, Levels, Pending
from appliance.core.batcher import DynamicBatcher
from appliance.core.batching import BatchPolicy, BatchResult
from appliance.core.instances import InstanceGroup
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, Code, FailureReason
from appliance.request import InferenceRequest
from tests.core.test_batcher import LIMIT_S, Doubler, run, until, x

# ---- the queue alone --------------------------------------------------------------------


def item(level: int = 0, rows: int = 1, name: str = "") -> Pending:
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
    finally:
        loop.close()
    return Pending({}, (name,), rows, "s", 0.0, future, level=level)


def names(queue: BatchQueue) -> list[str]:
    return [p.outputs[0] for p in queue]


def test_levels_first_then_arrival_then_the_delayed_in_the_order_they_timed_out() -> None:
    q = BatchQueue(Levels(None, 64))
    a, b, c, d = item(2, name="a"), item(2, name="b"), item(1, name="c"), item(2, name="d")
    assert not q.push(a) and not q.push(b)
    assert q.push(c)  # ahead of level 2
    assert q.delay(a) and q.delay(b)  # both timed out under DELAY, a first
    assert names(q) == ["c", "a", "b"]
    assert q.push(d)  # a request that has not timed out goes ahead of the delayed
    assert names(q) == ["c", "d", "a", "b"]
    assert not q.delay(a)  # delayed once only
    assert q.count(2) == 3 and q.count(1) == 1 and q.rows == 4


def test_remove_pop_and_clear_keep_the_counts_and_rows_exact() -> None:
    q = BatchQueue(Levels(None, 64))
    items = [item(1 + i % 2, rows=i + 1, name=str(i)) for i in range(5)]
    for it in items:
        q.push(it)
    assert names(q) == ["0", "2", "4", "1", "3"]
    assert q.remove(items[2]) and not q.remove(items[2])  # withdrawn exactly once
    assert not q.delay(items[2])  # no longer queued: nothing moves
    taken = q.pop((0, 2))
    assert [t.outputs[0] for t in taken] == ["0", "1"]
    assert names(q) == ["4", "3"] and q.rows == 5 + 4
    assert q.count(1) == 1 and q.count(2) == 1
    assert len(q.clear()) == 2 and q.rows == 0 and q.count(1) == 0 and not q


def test_levels_give_each_level_its_policy_and_bound() -> None:
    db = DynamicBatching(
        max_queue_size=0,
        default_timeout_us=1000,
        priority_levels=3,
        default_priority_level=2,
        priority_queue_policy=((1, QueuePolicy(max_queue_size=2, timeout_action="DELAY")),),
    )
    levels = Levels(db, 64)
    assert levels.bound(1) == 2 and levels.bound(2) == 64  # 0: the server's bound
    assert levels.delays(1) and not levels.delays(2)
    assert levels.timeout_s(1, None) is None and levels.timeout_s(2, None) == 0.001


def test_a_request_timeout_may_only_shorten_the_default_and_only_when_allowed() -> None:
    allowed = Levels(DynamicBatching(default_timeout_us=1000), 8)
    assert allowed.timeout_s(0, 500) == 0.0005  # shorter: it applies
    assert allowed.timeout_s(0, 5000) == 0.001  # longer: the default stays (Triton's rule)
    assert allowed.timeout_s(0, 0) == 0.001
    fixed = Levels(DynamicBatching(default_timeout_us=1000, allow_timeout_override=False), 8)
    assert fixed.timeout_s(0, 500) == 0.001
    no_default = Levels(DynamicBatching(), 8)
    assert no_default.timeout_s(0, 500) == 0.0005  # no default: the request's own
    assert no_default.timeout_s(0, None) is None


def test_config_parses_priority_queue_policy_and_rejects_bad_levels() -> None:
    cfg = parse_model_config(
        {
            "max_batch_size": 4,
            "dynamic_batching": {
                "priority_levels": 2,
                "default_priority_level": 2,
                "default_queue_policy": {"timeout_action": "DELAY"},
                "priority_queue_policy": {"1": {"max_queue_size": 3}},
            },
        },
        "m",
        "m/config.yaml",
    )
    db = cfg.dynamic_batching
    assert db is not None and db.timeout_action == "DELAY"
    assert db.priority_queue_policy == ((1, QueuePolicy(max_queue_size=3)),)
    for bad, message in [
        ({"3": {}}, "priority_queue_policy.3: expected a priority level in 1..2"),
        ({"0": {}}, "priority_queue_policy.0: expected a priority level in 1..2"),
        ({"x": {}}, "priority_queue_policy.x: expected a priority level (an integer)"),
        (
            {"1": {"timeout_action": "DROP"}},
            "priority_queue_policy.1.timeout_action: expected REJECT or DELAY, got 'DROP'",
        ),
        ({"1": {"max_queue_size": -1}}, "priority_queue_policy.1.max_queue_size: expected"),
    ]:
        data = {
            "dynamic_batching": {
                "priority_levels": 2,
                "default_priority_level": 1,
                "priority_queue_policy": bad,
            }
        }
        with pytest.raises(ApplianceError) as info:
            parse_model_config(data, "m", "m/config.yaml")
        assert message in info.value.message, info.value.message
    with pytest.raises(ApplianceError, match="priority_queue_policy needs priority_levels"):
        parse_model_config(
            {"dynamic_batching": {"priority_queue_policy": {"1": {}}}}, "m", "m/config.yaml"
        )


# ---- the batcher, its timeouts fired by the test ----------------------------------------


class Clock:
    """Stands in for ``loop.call_later``: records each armed timeout; the test fires it."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[..., Any], tuple[Any, ...], Handle]] = []

    def __call__(self, delay: float, callback: Callable[..., Any], *args: Any) -> Handle:
        handle = Handle()
        self.armed.append((delay, callback, args, handle))
        return handle

    def fire(self, index: int) -> bool:
        """Fire the ``index``-th armed timeout unless it was cancelled (as the loop does)."""
        _, callback, args, handle = self.armed[index]
        if handle.cancelled:
            return False
        callback(*args)
        return True


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


ONE_AT_A_TIME = BatchPolicy(
    max_batch_size=8, dynamic=False, priority_levels=2, default_priority_level=2
)


async def make(
    backend: Doubler, db: DynamicBatching, policy: BatchPolicy = ONE_AT_A_TIME
) -> tuple[DynamicBatcher, InstanceGroup, ModelStats, Clock]:
    group = await InstanceGroup.create("m", 1, lambda i: backend)
    stats = ModelStats("m", "1")
    clock = Clock()
    batcher = DynamicBatcher("m:1", group, policy, 16, stats, Levels(db, 16), clock)
    return batcher, group, stats, clock


def request(value: float, priority: int = 0, timeout_us: int | None = None) -> InferenceRequest:
    return InferenceRequest(
        "m", {"x": x(value)}, priority=priority, timeout_us=timeout_us, id=f"r{value:g}"
    )


def enqueue(batcher: DynamicBatcher, req: InferenceRequest) -> asyncio.Task[BatchResult]:
    async def go() -> BatchResult:
        return await batcher.enqueue(req, ("y",), 1, (2,), None)

    return asyncio.get_running_loop().create_task(go())


def values(backend: Doubler) -> list[float]:
    return [float(c[0, 0]) for c in backend.calls]


def test_delay_keeps_a_late_request_and_runs_it_after_its_level_ones_that_are_not() -> None:
    backend = Doubler(hold=True)
    db = DynamicBatching(
        default_timeout_us=1000,
        timeout_action="DELAY",
        priority_levels=2,
        default_priority_level=2,
    )

    async def main() -> None:
        batcher, group, stats, clock = await make(backend, db)
        running = enqueue(batcher, request(0))
        await until(backend.started.is_set)
        late = enqueue(batcher, request(1))
        await until(lambda: batcher.pending == 1)
        assert clock.fire(1)  # 1's timeout passes while the instance is busy: it stays queued
        others = [enqueue(batcher, request(2)), enqueue(batcher, request(3, priority=1))]
        await until(lambda: batcher.pending == 3)
        assert stats.pending == 3
        backend.release.set()
        done = await asyncio.gather(running, late, *others)
        assert [r.outputs["y"][0, 0] for r in done] == [0, 2, 4, 6]
        # level 1 first, then level 2's request that did not time out, then the late one
        assert values(backend) == [0, 3, 2, 1]
        await batcher.stop(LIMIT_S)
        await group.close()

    run(main())


def test_reject_answers_a_late_request_with_tritons_error_and_releases_its_place() -> None:
    backend = Doubler(hold=True)
    db = DynamicBatching(
        default_timeout_us=1000,
        priority_levels=2,
        default_priority_level=2,
        priority_queue_policy=((1, QueuePolicy(max_queue_size=1)),),
    )

    async def main() -> None:
        batcher, group, stats, clock = await make(backend, db)
        running = enqueue(batcher, request(0))
        await until(backend.started.is_set)
        urgent = enqueue(batcher, request(1, priority=1))
        await until(lambda: batcher.pending == 1)
        # level 1 has its own policy (no timeout): only request 0 (level 2) was armed
        assert len(clock.armed) == 1 and clock.armed[0][0] == pytest.approx(0.001)
        full = enqueue(batcher, request(2, priority=1))
        with pytest.raises(ApplianceError) as info:
            await full
        assert info.value.code is Code.UNAVAILABLE
        assert info.value.message == "[request id: r2] Exceeds maximum queue size"
        late = enqueue(batcher, request(3, timeout_us=500))
        await until(lambda: batcher.pending == 2)
        assert clock.armed[-1][0] == pytest.approx(0.0005)  # shorter: the request's own
        assert clock.fire(len(clock.armed) - 1)
        with pytest.raises(ApplianceError) as info:
            await late
        assert info.value.message == "Request timeout expired"
        assert info.value.reason is FailureReason.REJECTED
        assert batcher.pending == 1 and stats.pending == 1
        backend.release.set()
        assert (await urgent).outputs["y"][0, 0] == 2
        await running
        assert values(backend) == [0, 1]  # the rejected ones never ran
        await batcher.stop(LIMIT_S)
        await group.close()

    run(main())


def test_a_cancelled_or_answered_request_is_not_touched_by_its_timer() -> None:
    backend = Doubler(hold=True)
    db = DynamicBatching(default_timeout_us=1000, timeout_action="DELAY")

    async def main() -> None:
        policy = BatchPolicy(max_batch_size=8, dynamic=False)
        batcher, group, _, clock = await make(backend, db, policy)
        running = enqueue(batcher, request(0))
        await until(backend.started.is_set)
        gone = enqueue(batcher, request(1))
        await until(lambda: batcher.pending == 1)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert batcher.pending == 0
        assert clock.armed[1][3].cancelled  # withdrawn: its timer went with it
        backend.release.set()
        await running
        assert clock.armed[0][3].cancelled  # delivered: its timer too
        await batcher.stop(LIMIT_S)
        await group.close()

    run(main())


def test_many_levels_under_a_burst_all_answered_and_the_queue_empty_after() -> None:
    backend = Doubler()
    db = DynamicBatching(
        default_timeout_us=10_000_000,
        timeout_action="DELAY",
        priority_levels=3,
        default_priority_level=2,
    )

    async def main() -> None:
        policy = BatchPolicy(
            max_batch_size=4, dynamic=True, priority_levels=3, default_priority_level=2
        )
        batcher, group, stats, clock = await make(backend, db, policy)
        tasks = [enqueue(batcher, request(i, priority=i % 4)) for i in range(12)]
        for i in range(0, len(clock.armed), 3):
            clock.fire(i)  # some time out while queued (or after they ran: no effect)
        results = await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)
        assert sorted(float(r.outputs["y"][0, 0]) for r in results) == [2.0 * i for i in range(12)]
        assert batcher.pending == 0 and stats.pending == 0
        await batcher.stop(LIMIT_S)
        await group.close()

    run(main())
