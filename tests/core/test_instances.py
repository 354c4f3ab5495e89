"""Instance groups: one worker thread per instance, concurrency across instances,
clean creation failure and close, and the per-instance CPU share."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np
import pytest

from appliance.backends.base import TensorSpec
from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.core.batcher import DynamicBatcher
from appliance.core.batching import BatchPolicy
from appliance.core.instances import InstanceGroup, cpu_share
from appliance.core.loader import thread_share
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, Code

T = TypeVar("T")
LIMIT_S = 5.0
ONE_AT_A_TIME = BatchPolicy(max_batch_size=8, dynamic=False)


class Recorder:
    """``y = 2 x``; remembers the thread that built it, ran each infer and closed it.

    With a ``barrier``, every infer waits until as many calls are inside infer at
    once as the barrier has parties (or fails after its timeout).
    """

    inputs = [TensorSpec("x", "FP32", (-1, 1))]
    outputs = [TensorSpec("y", "FP32", (-1, 1))]

    def __init__(self, index: int, barrier: threading.Barrier | None = None) -> None:
        self.index = index
        self.barrier = barrier
        self.created_on = threading.get_ident()
        self.infer_threads: list[int] = []
        self.close_threads: list[int] = []

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        self.infer_threads.append(threading.get_ident())
        if self.barrier is not None:
            self.barrier.wait()
        return {"y": inputs["x"] * 2}

    def close(self) -> None:
        self.close_threads.append(threading.get_ident())


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 10 * LIMIT_S)

    return asyncio.run(bounded())


async def infer_all(batcher: DynamicBatcher, values: list[float]) -> list[float]:
    results = await asyncio.gather(
        *(batcher.submit({"x": np.array([[v]], np.float32)}, ("y",), 1, (1,), None) for v in values)
    )
    return [float(r.outputs["y"][0, 0]) for r in results]


def test_two_instances_run_two_batches_at_the_same_time() -> None:
    barrier = threading.Barrier(2, timeout=LIMIT_S)  # breaks unless both calls overlap
    made: list[Recorder] = []

    def factory(i: int) -> Recorder:
        made.append(Recorder(i, barrier))
        return made[-1]

    async def main() -> None:
        group = await InstanceGroup.create("m", 2, factory)
        assert len(group.instances) == 2
        batcher = DynamicBatcher("m:1", group, ONE_AT_A_TIME, 8, ModelStats("m", "1"))
        assert await infer_all(batcher, [1, 2]) == [2, 4]
        assert sorted(len(r.infer_threads) for r in made) == [1, 1]
        assert made[0].infer_threads[0] != made[1].infer_threads[0]
        await batcher.stop(LIMIT_S)
        await group.close()
        assert [len(r.close_threads) for r in made] == [1, 1]

    run(main())
    assert not barrier.broken


def test_each_instance_is_built_used_and_closed_on_its_own_thread() -> None:
    made: list[Recorder] = []

    def factory(i: int) -> Recorder:
        made.append(Recorder(i))
        return made[-1]

    async def main() -> None:
        group = await InstanceGroup.create("m", 2, factory)
        assert len(group.instances) == 2
        batcher = DynamicBatcher("m:1", group, ONE_AT_A_TIME, 64, ModelStats("m", "1"))
        for _ in range(3):
            values = [float(v) for v in range(12)]
            assert await infer_all(batcher, values) == [2 * v for v in values]
        await batcher.stop(LIMIT_S)
        await group.close()

    run(main())
    assert sorted(r.index for r in made) == [0, 1]
    assert sum(len(r.infer_threads) for r in made) == 36
    main_thread = threading.get_ident()
    for r in made:
        assert r.created_on != main_thread  # never on the event loop's thread
        assert set(r.infer_threads) <= {r.created_on}
        assert r.close_threads == [r.created_on]
    assert made[0].created_on != made[1].created_on


def test_close_closes_every_backend_exactly_once() -> None:
    made: list[Recorder] = []

    def factory(i: int) -> Recorder:
        made.append(Recorder(i))
        return made[-1]

    async def main() -> None:
        group = await InstanceGroup.create("m", 3, factory)
        await group.close()

    run(main())
    assert len(made) == 3
    assert [len(r.close_threads) for r in made] == [1, 1, 1]


def test_a_failing_factory_closes_the_instances_already_made_and_raises() -> None:
    made: list[Recorder] = []

    def factory(i: int) -> Recorder:
        if i == 1:
            raise ApplianceError(Code.INTERNAL, "instance 1 could not load")
        made.append(Recorder(i))
        return made[-1]

    async def main() -> None:
        with pytest.raises(ApplianceError, match="instance 1 could not load"):
            await InstanceGroup.create("m", 3, factory)

    run(main())
    assert sorted(r.index for r in made) == [0, 2]
    for r in made:
        assert r.close_threads == [r.created_on]


def test_cpu_share_splits_the_usable_cores_and_is_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cpu_share(1) >= 1
    for count in (1, 2, 3, 1000):
        assert 1 <= cpu_share(count) <= cpu_share(1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [cpu_share(n) for n in (0, 1, 2, 3, 4, 8, 9, 64)] == [8, 8, 4, 2, 2, 1, 1, 1]


def test_thread_share_gives_a_shared_engine_every_core_unless_pinned() -> None:
    def cfg(data: dict[str, object]) -> ModelConfig:
        return parse_model_config({"backend": "onnxruntime", **data}, "m", "m/config.yaml")

    two = cfg({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]})
    assert thread_share(two) == (cpu_share(2), cpu_share(1))  # own engines split, a shared one not
    assert thread_share(cfg({})) == (cpu_share(1), cpu_share(1))
    pinned = cfg({"instance_group": [{"count": 2}], "parameters": {"intra_op_thread_count": "3"}})
    assert thread_share(pinned) == (3, 3)
