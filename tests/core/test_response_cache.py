"""Triton's response cache: the key, the bound and eviction (no server), and a model
answered from the cache without running, with Triton's statistics and metrics."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from appliance.core.response_cache import ResponseCache
from devtools import modelgen


def test_the_key_covers_model_version_inputs_and_outputs() -> None:
    x = {"a": np.arange(4, dtype=np.int32), "b": np.array([b"x", b"yz"], dtype=object)}
    key = ResponseCache.key("m", "1", x, ("o",))
    assert key == ResponseCache.key("m", "1", {"b": x["b"], "a": x["a"].copy()}, ("o",))
    others = [
        ResponseCache.key("n", "1", x, ("o",)),
        ResponseCache.key("m", "2", x, ("o",)),
        ResponseCache.key("m", "1", x, ("o", "p")),
        ResponseCache.key("m", "1", {**x, "a": x["a"].reshape(2, 2)}, ("o",)),
        ResponseCache.key("m", "1", {**x, "a": x["a"].astype(np.int64)}, ("o",)),
        ResponseCache.key("m", "1", {**x, "b": np.array([b"xy", b"z"], dtype=object)}, ("o",)),
        # request parameters a model may answer by (a Python model's parameters())
        ResponseCache.key("m", "1", x, ("o",), {"mode": "fast"}),
        ResponseCache.key("m", "1", x, ("o",), {"mode": "slow"}),
        ResponseCache.key("m", "1", x, ("o",), {"n": 1}),
        ResponseCache.key("m", "1", x, ("o",), {"n": "1"}),
        ResponseCache.key("m", "1", x, ("o",), {"n": True}),
    ]
    assert len({key, *others}) == 1 + len(others)
    assert key == ResponseCache.key("m", "1", x, ("o",), {})  # none given: the same
    assert ResponseCache.key("m", "1", x, ("o",), {"a": 1, "b": 2}) == ResponseCache.key(
        "m", "1", x, ("o",), {"b": 2, "a": 1}
    )


def test_entries_are_copies_within_the_bound_least_recently_used_first_out() -> None:
    cache = ResponseCache(limit=100)
    row = np.zeros(10, dtype=np.int32)  # 40 bytes
    cache.put(b"a", {"y": row})
    row[0] = 7  # the caller's array changes: the cache kept a copy
    got = cache.get(b"a")
    assert got is not None and got["y"][0] == 0
    with pytest.raises(ValueError):
        got["y"][0] = 1  # read-only: no caller changes what the next one gets
    cache.put(b"b", {"y": np.zeros(10, np.int32)})
    cache.get(b"a")  # a is now the most recently used
    cache.put(b"c", {"y": np.zeros(10, np.int32)})  # 120 > 100: b goes
    assert cache.get(b"b") is None and cache.get(b"a") is not None
    assert cache.used == 80 and cache.evictions == 1
    cache.put(b"huge", {"y": np.zeros(100, np.int32)})  # larger than the cache: not kept
    assert cache.get(b"huge") is None and cache.used == 80


CONFIG = """\
backend: onnxruntime
max_batch_size: 8
input: [{name: INPUT0, data_type: TYPE_FP32, dims: [-1]}]
output: [{name: OUTPUT0, data_type: TYPE_FP32, dims: [-1]}]
response_cache: {enable: true}
"""


def test_a_request_seen_before_is_answered_without_running_the_model(
    run_appliance, tmp_path: Path
) -> None:
    modelgen.write_model(tmp_path, "cached", modelgen.identity("FP32", [-1]), CONFIG)
    modelgen.write_model(
        tmp_path, "plain", modelgen.identity("FP32", [-1]), CONFIG.replace("true", "false")
    )
    srv = run_appliance(tmp_path, response_cache_size="1MiB")
    client = httpclient.InferenceServerClient(srv.url)

    def ask(model: str, value: float) -> list[list[float]]:
        tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
        tensor.set_data_from_numpy(np.full((1, 3), value, np.float32))
        return client.infer(model, [tensor]).as_numpy("OUTPUT0").tolist()

    for model in ("cached", "plain"):
        assert ask(model, 1.0) == [[1.0] * 3]
        assert ask(model, 1.0) == [[1.0] * 3]
        assert ask(model, 2.0) == [[2.0] * 3]
    cached = client.get_inference_statistics("cached")["model_stats"][0]
    assert cached["inference_count"] == 2  # the model ran for 1.0 and 2.0 only
    assert cached["inference_stats"]["success"]["count"] == 3
    assert cached["inference_stats"]["cache_hit"]["count"] == 1
    assert cached["inference_stats"]["cache_miss"]["count"] == 2
    plain = client.get_inference_statistics("plain")["model_stats"][0]
    assert plain["inference_count"] == 3 and plain["inference_stats"]["cache_hit"]["count"] == 0
    metrics = urllib.request.urlopen(srv.metrics_url).read().decode()
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 1' in metrics
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 2' in metrics
    assert client.get_model_config("cached")["response_cache"] == {"enable": True}
    # the same answer over gRPC, from the cache (the key is the request, not the wire)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.full((1, 3), 2.0, np.float32))
    assert grpc.infer("cached", [tensor]).as_numpy("OUTPUT0").tolist() == [[2.0] * 3]
    again = client.get_inference_statistics("cached")["model_stats"][0]
    assert again["inference_stats"]["cache_hit"]["count"] == 2
    assert again["inference_count"] == 2
    # the cache's size is charged to the memory budget
    assert srv.server.lifecycle.budget.model_usage("<response cache>") == 2**20


def test_response_cache_size_is_a_size() -> None:
    assert load_server_config(None, {"response_cache_size": "64MiB"}).response_cache_size == 2**26
    assert load_server_config(None, {}).response_cache_size == 0
    with pytest.raises(ConfigError, match="response_cache_size"):
        load_server_config(None, {"response_cache_size": "lots"})
