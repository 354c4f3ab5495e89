"""Dynamic batching through the real server: requests really share backend calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from devtools import modelgen


def _repo(tmp_path: Path) -> Path:
    # a generous delay so concurrent requests from the test threads meet in the queue
    batching = "dynamic_batching: {max_queue_delay_microseconds: 400000}\n"
    modelgen.write_model(
        tmp_path, "simple", modelgen.simple_add_sub(), "max_batch_size: 8\n" + batching
    )
    modelgen.write_model(
        tmp_path, "echo", modelgen.identity("FP32", [-1]), "max_batch_size: 8\n" + batching
    )
    modelgen.write_model(
        tmp_path, "simple_nobatch", modelgen.simple_add_sub(), "max_batch_size: 8\n"
    )
    return tmp_path


def _simple_all(client, model: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Send every request at once (tritonclient's async_infer), then collect."""
    pending = []
    for a in arrays:
        inputs = [httpclient.InferInput(n, list(a.shape), "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(np.ones_like(a))
        pending.append(client.async_infer(model, inputs))
    return [p.get_result().as_numpy("OUTPUT0") for p in pending]


def _stats(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def test_concurrent_requests_share_batches(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_repo(tmp_path))
    client = httpclient.InferenceServerClient(srv.url, concurrency=8)
    # rows per request: 1, 2 or 3, so multi-row requests are merged too
    arrays = [np.full((1 + i % 3, 16), i, dtype=np.int32) for i in range(8)]
    results = _simple_all(client, "simple", arrays)
    for a, got in zip(arrays, results, strict=True):
        np.testing.assert_array_equal(got, a + 1)  # each caller got exactly its own rows
    stats = _stats(client, "simple")
    assert stats["inference_count"] == sum(len(a) for a in arrays)
    assert stats["execution_count"] < 8
    assert max(b["batch_size"] for b in stats["batch_stats"]) > 1
    assert all(b["batch_size"] <= 8 for b in stats["batch_stats"])


def test_without_dynamic_batching_each_request_runs_alone(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_repo(tmp_path))
    client = httpclient.InferenceServerClient(srv.url, concurrency=4)
    arrays = [np.full((2, 16), i, dtype=np.int32) for i in range(4)]
    results = _simple_all(client, "simple_nobatch", arrays)
    for a, got in zip(arrays, results, strict=True):
        np.testing.assert_array_equal(got, a + 1)
    stats = _stats(client, "simple_nobatch")
    assert stats["execution_count"] == 4 and stats["inference_count"] == 8
    assert [b["batch_size"] for b in stats["batch_stats"]] == [2]


def test_different_shapes_are_never_merged(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_repo(tmp_path))
    client = httpclient.InferenceServerClient(srv.url, concurrency=4)
    arrays = [np.full((1, 3 + 2 * (i % 2)), i, dtype=np.float32) for i in range(4)]
    pending = []
    for a in arrays:
        inp = httpclient.InferInput("INPUT0", list(a.shape), "FP32")
        inp.set_data_from_numpy(a)
        pending.append(client.async_infer("echo", [inp]))
    for a, p in zip(arrays, pending, strict=True):
        np.testing.assert_array_equal(p.get_result().as_numpy("OUTPUT0"), a)
    stats = _stats(client, "echo")
    # two shapes, so at least two executions; never one call carrying all four
    assert 2 <= stats["execution_count"] <= 4
    assert stats["inference_count"] == 4
