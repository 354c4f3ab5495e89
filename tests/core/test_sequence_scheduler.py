"""The SequenceBatcher driving a deterministic fake backend: order, affinity, backlog,
cancellation, stop. Every wait is bounded, so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from appliance.backends.base import TensorSpec
from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.core.batching import BatchResult
from appliance.core.instances import InstanceGroup
from appliance.core.sequence.batcher import SequenceBatcher
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceRequest

T = TypeVar("T")
LIMIT_S = 10.0  # upper bound on any single wait; only reached when a test is failing


class Recorder:
    """Returns INPUT and records (instance, CORRID, INPUT, START) per batch row;
    blocks each call while ``gate`` is clear."""

    def __init__(self, index: int, log: list[tuple[int, int, int, int]], gate: threading.Event):
        self.index, self.log, self.gate = index, log, gate
        self.inputs = [TensorSpec("INPUT", "INT32", (-1, 1))]
        self.outputs = [TensorSpec("OUTPUT", "INT32", (-1, 1))]

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        assert self.gate.wait(LIMIT_S)
        for row in range(inputs["INPUT"].shape[0]):
            if inputs["READY"][row, 0]:
                self.log.append(
                    (
                        self.index,
                        int(inputs["CORRID"][row, 0]),
                        int(inputs["INPUT"][row, 0]),
                        int(inputs["START"][row, 0]),
                    )
                )
        return {"OUTPUT": inputs["INPUT"]}

    def close(self) -> None:
        pass


def config(strategy: str = "direct") -> ModelConfig:
    flag = {"int32_false_true": [0, 1]}
    return parse_model_config(
        {
            "max_batch_size": 2,
            "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
            "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
            "sequence_batching": {
                strategy: {},
                "control_input": [
                    {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", **flag}]},
                    {"name": "READY", "control": [{"kind": "CONTROL_SEQUENCE_READY", **flag}]},
                    {
                        "name": "CORRID",
                        "control": [
                            {"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}
                        ],
                    },
                ],
            },
        },
        "seq",
        "seq/config.yaml",
    )


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)  # bounded by run()'s limit


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, LIMIT_S)

    return asyncio.run(bounded())


async def make(
    count: int, gate: threading.Event, strategy: str = "direct", queue: int = 100
) -> tuple[SequenceBatcher, InstanceGroup, list[tuple[int, int, int, int]]]:
    log: list[tuple[int, int, int, int]] = []
    group = await InstanceGroup.create("seq", count, lambda i: Recorder(i, log, gate))  # type: ignore[arg-type, return-value]
    return (
        SequenceBatcher("seq:1", config(strategy), group, ModelStats("seq", "1"), queue),
        group,
        log,
    )


def send(b: SequenceBatcher, sid: int, value: int, start: bool = False, end: bool = False) -> Any:
    request = InferenceRequest(
        "seq",
        {"INPUT": np.array([[value]], np.int32)},
        sequence_id=sid,
        sequence_start=start,
        sequence_end=end,
    )
    return b.enqueue(request, ("OUTPUT",), 1, (("INPUT", (1,)),), None)


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_sequences_run_in_order_on_one_instance_with_a_backlog(strategy: str) -> None:
    """Six sequences, four slots (two instances x max_batch_size 2): two wait in the
    backlog until others end; every sequence runs in order on one instance."""

    async def main() -> list[tuple[int, int, int, int]]:
        gate = threading.Event()
        gate.set()
        b, group, log = await make(2, gate, strategy)
        calls = [
            send(b, sid, step, start=step == 0, end=step == 4)
            for step in range(5)
            for sid in range(1, 7)
        ]
        results: list[BatchResult] = await asyncio.gather(*calls)
        assert [int(r.outputs["OUTPUT"][0, 0]) for r in results] == [
            step for step in range(5) for _ in range(1, 7)
        ]
        assert b.active_sequences == 0  # every sequence ended and gave its slot back
        await b.stop(1.0)
        await group.close()
        return log

    log = run(main())
    for sid in range(1, 7):
        rows = [(i, v, s) for i, c, v, s in log if c == sid]
        assert [v for _, v, _ in rows] == [0, 1, 2, 3, 4]
        assert [s for _, _, s in rows] == [1, 0, 0, 0, 0]
        assert len({i for i, _, _ in rows}) == 1


def test_a_cancelled_request_leaves_its_sequence_queue() -> None:
    async def main() -> list[tuple[int, int, int, int]]:
        gate = threading.Event()
        b, group, log = await make(1, gate)
        first = asyncio.ensure_future(send(b, 5, 1, start=True))
        await asyncio.sleep(0)  # queued and dispatched; the backend waits on the gate
        second = asyncio.ensure_future(send(b, 5, 2))
        await asyncio.sleep(0)
        second.cancel()
        gate.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        await send(b, 5, 3, end=True)
        await b.stop(1.0)
        await group.close()
        return log

    assert [(c, v) for _, c, v, _ in run(main())] == [(5, 1), (5, 3)]


def test_stop_drains_then_refuses() -> None:
    async def main() -> None:
        gate = threading.Event()
        b, group, _ = await make(1, gate)
        pending = [asyncio.ensure_future(send(b, 8, v, start=v == 0)) for v in range(3)]
        await asyncio.sleep(0)
        gate.set()
        await b.stop(LIMIT_S / 2)
        assert [int(p.result().outputs["OUTPUT"][0, 0]) for p in pending] == [0, 1, 2]
        with pytest.raises(ApplianceError) as info:
            await send(b, 9, 1, start=True)
        assert info.value.code == Code.UNAVAILABLE
        await group.close()

    run(main())


def test_a_full_queue_is_refused() -> None:
    async def main() -> None:
        gate = threading.Event()
        b, group, _ = await make(1, gate, queue=2)
        first = asyncio.ensure_future(send(b, 1, 0, start=True))
        await until(lambda: b.active_sequences == 1 and b.pending == 0)  # running, not queued
        queued = [asyncio.ensure_future(send(b, 1, v)) for v in (1, 2)]
        await until(lambda: b.pending == 2)
        with pytest.raises(ApplianceError, match="queue is full") as info:
            await send(b, 1, 3)
        assert info.value.code == Code.UNAVAILABLE
        gate.set()
        await asyncio.gather(first, *queued)
        await b.stop(1.0)
        await group.close()

    run(main())
