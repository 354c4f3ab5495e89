"""The rate limiter (Triton's ``--rate-limit=execution_count``): resources, totals and
the order of turns alone, then batchers of two models sharing a global resource with
backends the test holds and releases (outcomes, never timing margins)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import pytest

from appliance.config.model_config import InstanceGroup as GroupConfig
from appliance.config.model_config import parse_model_config
from appliance.config.scheduling_config import (
    RateLimiterConfig,
    Resource,
    ResourceTotal,
)
from appliance.config.server_config import load_server_config
from appliance.core import scheduler
from appliance.core.batcher import DynamicBatcher
from appliance.core.batching import BatchPolicy
from appliance.core.instances import InstanceGroup
from appliance.core.rate_limiter import RateLimiter, from_settings
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, Code
from tests.core.test_batcher import LIMIT_S, Doubler, run, submit, until, x
from tests.core.test_sequence_scheduler import Recorder
from tests.core.test_sequence_scheduler import config as sequence_config

NPU = RateLimiterConfig((Resource("npu", 1, is_global=True),))


def nothing() -> None:
    pass


def limits(*resources: Resource, priority: int = 1) -> RateLimiterConfig:
    return RateLimiterConfig(tuple(resources), priority)


# ---- the limiter alone --------------------------------------------------------------------


def test_without_totals_a_resource_has_the_most_any_instance_needs() -> None:
    limiter = RateLimiter()
    a, b = limiter.register("a", [limits(Resource("r", 2)), limits(Resource("r", 3))], 2, nothing)
    assert limiter.acquire(a) == (True, [])
    assert limiter.acquire(b) == (False, [])  # 2 + 3 > 3: in line
    granted = limiter.release(a)
    assert granted == [b] and b.granted and limiter.in_use() == {(0, "r"): 3}
    assert limiter.release(b) == [] and limiter.in_use() == {}


def test_totals_given_bound_each_resource_and_too_few_fails_the_load_with_tritons_text() -> None:
    limiter = RateLimiter([ResourceTotal("r", 1), ResourceTotal("npu", 1, device=3)])
    with pytest.raises(ApplianceError) as info:
        limiter.register("m", [limits(Resource("r", 2))], 1, nothing)
    assert info.value.code is Code.INVALID_ARG
    assert info.value.message == (
        'Resource count for "r" is limited to 1 which will prevent scheduling of one or '
        "more model instances, the minimum required count is 2"
    )
    with pytest.raises(ApplianceError, match='"other" is limited to 0'):
        limiter.register("m", [limits(Resource("other", 1))], 1, nothing)  # not named: none
    # a global resource takes the largest count given for its name, whatever the device
    (t,) = limiter.register("m", [NPU], 1, nothing)
    assert limiter.acquire(t) == (True, [])


def test_a_name_both_global_and_per_device_is_refused_and_nothing_registered() -> None:
    limiter = RateLimiter()
    limiter.register("a", [NPU], 1, nothing)
    with pytest.raises(ApplianceError, match='Resource "npu" is present as both global and'):
        limiter.register("b", [limits(Resource("npu", 1))], 1, nothing)
    (ok,) = limiter.register("c", [limits(Resource("dsp", 1))], 1, nothing)
    assert limiter.acquire(ok)[0]


def test_turns_go_by_executions_times_priority_and_the_first_in_line_is_not_passed() -> None:
    limiter = RateLimiter()
    fast, slow = limiter.register(
        "m",
        [limits(Resource("r", 1), priority=1), limits(Resource("r", 1), priority=2)],
        2,
        nothing,
    )
    (big,) = limiter.register("big", [limits(Resource("r", 1))], 1, nothing)
    assert limiter.acquire(fast)[0]  # fast: 1 execution
    assert not limiter.acquire(big)[0]  # in line first (0 executions)
    assert not limiter.acquire(slow)[0]
    assert limiter.release(fast) == [big]  # the first in line
    assert not limiter.acquire(fast)[0]  # fast again: 1 x 1, behind slow's 0 x 2
    assert limiter.release(big) == [slow]
    assert limiter.release(slow) == [fast]  # slow: 1 x 2 now; fast 1 x 1 goes first
    assert not limiter.acquire(slow)[0]
    assert limiter.withdraw(fast) == [slow]  # a grant given back unused goes on


def test_an_unloaded_model_leaves_the_line_and_a_running_ticket_keeps_its_resources() -> None:
    limiter = RateLimiter()
    a, b = limiter.register("m", [NPU, NPU], 2, nothing)
    (other,) = limiter.register("o", [NPU], 1, nothing)
    assert limiter.acquire(a)[0] and not limiter.acquire(b)[0] and not limiter.acquire(other)[0]
    assert limiter.unregister([a, b]) == []  # a still runs: the npu stays taken
    assert limiter.in_use() == {(None, "npu"): 1}
    assert limiter.release(a) == [other]  # b left the line
    assert limiter.release(other) == [] and limiter.in_use() == {}


def test_config_fields_are_validated_with_precise_errors() -> None:
    def error(group: dict[str, Any]) -> str:
        with pytest.raises(ApplianceError) as info:
            parse_model_config({"instance_group": [group]}, "m", "m/config.yaml")
        return info.value.message

    base = "m/config.yaml: instance_group[0].rate_limiter"
    assert error({"rate_limiter": {"resources": [{"count": 1}]}}) == (
        f"{base}.resources[0].name: expected a non-empty name, got None"
    )
    assert "letters, digits" in error({"rate_limiter": {"resources": [{"name": "a:b"}]}})
    assert error({"rate_limiter": {"resources": [{"name": "r", "count": -1}]}}).startswith(
        f"{base}.resources[0].count: expected an integer >= 0"
    )
    assert "named twice" in error(
        {"rate_limiter": {"resources": [{"name": "r", "count": 1}, {"name": "r", "count": 2}]}}
    )
    assert error({"rate_limiter": {"priority": "high"}}).startswith(f"{base}.priority: expected")
    assert "unknown field" in error({"rate_limiter": {"resources": [{"name": "r", "cnt": 1}]}})


def test_the_server_setting_is_validated_and_off_by_default() -> None:
    assert from_settings("off", ()) is None
    config = load_server_config(None, {})
    assert config.rate_limit == "off" and config.rate_limit_resources == ()
    config = load_server_config(
        None, {"rate_limit": "execution_count", "rate_limit_resources": ["npu:1", "dsp:2:0"]}
    )
    assert config.rate_limit_resources == (ResourceTotal("npu", 1), ResourceTotal("dsp", 2, 0))
    for bad, message in [
        ({"rate_limit": "on"}, "rate_limit: expected off or execution_count, got 'on'"),
        ({"rate_limit_resources": ["a:1"]}, "rate_limit_resources: given while rate_limit is off"),
        (
            {"rate_limit": "execution_count", "rate_limit_resources": ["a:x"]},
            "rate_limit_resources[0]: expected NAME:COUNT or NAME:COUNT:DEVICE, got 'a:x'",
        ),
        (
            {"rate_limit": "execution_count", "rate_limit_resources": ["a:1", "a:2"]},
            "rate_limit_resources[1]: 'a' is given twice for each device",
        ),
        (
            {"rate_limit": "execution_count", "rate_limit_resources": [{"name": "a"}]},
            "rate_limit_resources[0].count: expected the resource's count",
        ),
    ]:
        with pytest.raises(ApplianceError) as info:
            load_server_config(None, bad)
        assert info.value.message == f"<command line>: {message}"


# ---- batchers sharing a global resource ---------------------------------------------------

ALONE = BatchPolicy(max_batch_size=8, dynamic=False)


async def batcher(
    name: str, backend: Doubler, limiter: RateLimiter | None, count: int = 1
) -> tuple[DynamicBatcher, InstanceGroup]:
    group = await InstanceGroup.create(name, count, lambda i: backend)
    made = DynamicBatcher(
        f"{name}:1", group, ALONE, 16, ModelStats(name, "1"), limiter=limiter, limits=[NPU] * count
    )
    return made, group


def test_two_models_sharing_one_npu_run_one_at_a_time() -> None:
    first, second = Doubler(hold=True), Doubler(hold=True)

    async def main() -> None:
        limiter = RateLimiter()
        a, group_a = await batcher("a", first, limiter)
        b, group_b = await batcher("b", second, limiter)
        running = submit(a, x(1))
        await until(first.started.is_set)
        waiting = submit(b, x(2))
        await until(lambda: b.pending == 1 and b._tickets[0].staged)
        assert not second.started.is_set()  # b has its batch but not the npu
        assert limiter.in_use() == {(None, "npu"): 1}
        first.release.set()
        assert (await running).outputs["y"][0, 0] == 2
        await until(second.started.is_set)  # the npu went to b
        second.release.set()
        assert (await waiting).outputs["y"][0, 0] == 4
        await until(lambda: limiter.in_use() == {})
        for made, group in ((a, group_a), (b, group_b)):
            await made.stop(LIMIT_S)
            await group.close()

    run(main())


def test_instances_of_one_model_take_turns_and_a_stopped_model_frees_its_place() -> None:
    backend = Doubler(hold=True)
    other = Doubler(hold=True)

    async def main() -> None:
        limiter = RateLimiter()
        a, group_a = await batcher("a", backend, limiter, count=2)
        b, group_b = await batcher("b", other, limiter)
        tasks = [submit(a, x(1)), submit(a, x(2))]
        await until(backend.started.is_set)
        await until(lambda: a.pending == 1 and any(t.staged for t in a._tickets))
        assert len(backend.calls) == 1  # two instances, one npu: one runs
        queued_b = submit(b, x(3))
        await until(lambda: b._tickets[0].staged)
        await b.stop(0.0)  # unloaded while in line: its request fails, its place goes
        with pytest.raises(ApplianceError):
            await queued_b
        backend.release.set()
        assert sorted(float(r.outputs["y"][0, 0]) for r in await asyncio.gather(*tasks)) == [2, 4]
        # (an instance granted the npu for a batch another took gives it back at once)
        await until(lambda: limiter.in_use() == {})
        assert not other.calls
        await a.stop(LIMIT_S)
        for group in (group_a, group_b):
            await group.close()

    run(main())


def test_a_request_cancelled_while_its_instance_waits_does_not_block_the_line() -> None:
    first, second, third = Doubler(hold=True), Doubler(), Doubler()

    async def main() -> None:
        limiter = RateLimiter()
        a, group_a = await batcher("a", first, limiter)
        b, group_b = await batcher("b", second, limiter)
        c, group_c = await batcher("c", third, limiter)
        running = submit(a, x(1))
        await until(first.started.is_set)
        gone = submit(b, x(2))
        await until(lambda: b._tickets[0].staged)  # first in line for the npu
        later = submit(c, x(3))
        await until(lambda: c._tickets[0].staged)
        gone.cancel()  # b's queue empties while b stays first in line
        await asyncio.gather(gone, return_exceptions=True)
        first.release.set()
        await running
        # b is granted the npu for a batch it no longer has: it gives it back to c
        assert (await later).outputs["y"][0, 0] == 6
        assert not second.calls
        await until(lambda: limiter.in_use() == {})
        for made, group in ((a, group_a), (b, group_b), (c, group_c)):
            await made.stop(LIMIT_S)
            await group.close()

    run(main())


def test_off_no_tickets_and_batches_run_as_before() -> None:
    backend = Doubler()

    async def main() -> None:
        a, group = await batcher("a", backend, None)
        assert a._tickets == []
        results = await asyncio.gather(*(submit(a, x(v)) for v in range(4)))
        assert [r.outputs["y"][0, 0] for r in results] == [0, 2, 4, 6]
        await a.stop(LIMIT_S)
        await group.close()

    run(main())


def test_a_sequence_model_is_not_rate_limited_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    gate.set()
    seq = replace(sequence_config(), instance_group=(GroupConfig(1, "KIND_CPU", NPU),))

    async def main() -> None:
        group = await InstanceGroup.create("seq", 1, lambda i: Recorder(i, [], gate))  # type: ignore[arg-type, return-value]
        limiter = RateLimiter()
        made = scheduler.create(seq, "seq:1", group, ModelStats("seq", "1"), 8, limiter)
        assert "rate_limiter is ignored" in caplog.text
        # it registered nothing: its global npu would clash with this per-device one
        assert limiter.register("other", [limits(Resource("npu", 5))], 1, nothing)
        await made.stop(LIMIT_S)
        await group.close()

    run(main())
