"""The in-process API: same data plane, no sockets."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from appliance import ApplianceError, InProcessServer
from appliance.errors import Code
from devtools import modelgen


def test_async_use_matches_the_wire_behaviour() -> None:
    async def main() -> None:
        async with InProcessServer() as server:  # the demo repository
            # no endpoint was bound (a bound endpoint reports its port here)
            ports = (server.server.http_port, server.server.grpc_port, server.server.metrics_port)
            assert ports == (0, 0, 0)
            a = np.arange(32, dtype=np.int32).reshape(2, 16)
            out = await server.infer("simple", {"INPUT0": a, "INPUT1": a})
            np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
            np.testing.assert_array_equal(out["OUTPUT1"], np.zeros_like(a))
            only = await server.infer("simple", {"INPUT0": a, "INPUT1": a}, outputs=("OUTPUT1",))
            assert list(only) == ["OUTPUT1"]
            with pytest.raises(ApplianceError) as bad:
                await server.infer("simple", {"INPUT0": a.astype(np.float32), "INPUT1": a})
            assert bad.value.code == Code.INVALID_ARG
            assert "expected datatype INT32, got FP32" in bad.value.message
            with pytest.raises(ApplianceError) as missing:
                await server.infer("nope", {"x": a})
            assert missing.value.code == Code.INVALID_ARG  # as Triton: "Request for unknown model"
            stats = server.statistics("simple")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 2
            assert stats["inference_stats"]["fail"]["count"] == 1
            assert server.metadata("classifier")["inputs"][0]["shape"] == [-1, 3, 224, 224]

    asyncio.run(main())


def test_blocking_use_from_many_threads_batches(tmp_path: Path) -> None:
    modelgen.write_model(
        tmp_path,
        "simple",
        modelgen.simple_add_sub(),
        "max_batch_size: 8\ndynamic_batching: {max_queue_delay_microseconds: 300000}\n",
    )
    with InProcessServer(tmp_path) as server:
        assert [r["state"] for r in server.index()] == ["READY"]

        def call(i: int) -> np.ndarray:
            a = np.full((1, 16), i, dtype=np.int32)
            return server.infer_blocking("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"]

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(call, range(6)))
        for i, out in enumerate(results):
            np.testing.assert_array_equal(out, np.full((1, 16), 2 * i))
        stats = server.statistics("simple")["model_stats"][0]
        assert stats["inference_count"] == 6 and stats["execution_count"] < 6
    with pytest.raises(ApplianceError, match="not running"):
        server.infer_blocking("simple", {})
