"""Queued-bytes limits: overload sheds with 503, accepted requests still succeed, the
count returns to zero (appliance.core.queue_bytes).

A Python "gate" model holds each request in ``execute`` until the test opens the
gate (a file appears), so which requests are held at a given moment is decided by
the test, not by timing.
"""

from __future__ import annotations

import logging
import socket
import textwrap
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from http_helpers import metric_value
from mosquitto import wait_until
from tritonclient.utils import InferenceServerException

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from appliance.core.queue_bytes import QueuedBytes, default_limit, tensor_bytes
from appliance.core.stats import ModelStats

GATE_PY = """
import os
import time

from appliance import python_model as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = os.path.join(args["model_repository"], "open")  # the model's directory

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            # the warm-up's zeros pass; bounded: a broken test must not hang the server
            end = time.monotonic() + 60
            while x[0] > 0 and not os.path.exists(self.gate) and time.monotonic() < end:
                time.sleep(0.01)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
        return out
"""
FLOATS = 1000  # one request's tensor: 4000 bytes
GATE_CONFIG = f"""
backend: python
max_batch_size: 0
input: [{{name: IN, data_type: TYPE_FP32, dims: [{FLOATS}]}}]
output: [{{name: OUT, data_type: TYPE_FP32, dims: [{FLOATS}]}}]
instance_group: [{{count: 1, kind: KIND_CPU}}]
"""
LIMIT = "10000B"  # two requests' tensors fit (8000 bytes), a third does not


def test_hold_rules_without_a_server() -> None:
    queued = QueuedBytes(limit=100, per_model_limit=60)
    a, b = ModelStats("a", "1"), ModelStats("b", "1")
    first = queued.hold(a)
    first.set(50)
    with pytest.raises(Exception, match="model 'a' is overloaded"):
        queued.hold(a).set(20)  # 70 > a's 60
    second = queued.hold(b)
    second.set(50)  # b's own 50 fits; the server holds 100 now
    with pytest.raises(Exception, match="the server is overloaded"):
        queued.hold(b).set(1)
    assert (a.pending_bytes, b.pending_bytes, queued.held) == (50, 50, 100)
    second.set(10)  # shrinking always succeeds
    assert queued.held == 60
    first.release()
    first.release()  # a second release does nothing
    second.release()
    lone = queued.hold(a)
    lone.set(500)  # nothing else held: a lone request larger than the limits is served
    assert (a.pending_bytes, queued.held) == (500, 500)
    lone.release()
    assert (a.pending_bytes, b.pending_bytes, queued.held) == (0, 0, 0)


def test_tensor_bytes_counts_bytes_elements() -> None:
    strings = np.array([b"abc", b"", b"hello"], dtype=np.object_)
    floats = np.zeros((2, 3), np.float32)
    assert tensor_bytes({"s": strings, "f": floats}) == strings.nbytes + 8 + 24


def test_limits_in_the_server_config(tmp_path: Path) -> None:
    config = load_server_config(None, {"max_queued_bytes": "64MiB"})
    assert config.max_queued_bytes == 64 * 2**20 and config.max_queued_bytes_per_model is None
    assert load_server_config(None, {"max_queued_bytes": "auto"}).max_queued_bytes is None
    with pytest.raises(ConfigError, match="max_queued_bytes_per_model"):
        load_server_config(None, {"max_queued_bytes_per_model": "lots"})
    assert default_limit(2**30) == 2**28  # a quarter of the memory budget


def _gate_repository(tmp_path: Path, model_limit: bool) -> Path:
    version = tmp_path / "gate" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(GATE_PY))
    config = GATE_CONFIG
    if model_limit:
        config += f'parameters: {{max_queued_bytes: "{LIMIT}"}}\n'
    (tmp_path / "gate" / "config.yaml").write_text(config)
    return tmp_path


def _pending_bytes(metrics_url: str) -> int:
    held = metric_value(
        metrics_url, "nv_inference_pending_request_bytes", model="gate", version="1"
    )
    assert held is not None
    return int(held)


def _infer(url: str, value: float) -> np.ndarray:
    x = httpclient.InferInput("IN", [FLOATS], "FP32")
    x.set_data_from_numpy(np.full(FLOATS, value, np.float32))
    result = httpclient.InferenceServerClient(url, network_timeout=120).infer("gate", [x])
    out: np.ndarray = result.as_numpy("OUT")
    return out


@pytest.mark.parametrize("level", ["model", "server"])
def test_queued_bytes_limit_sheds_with_503_and_returns_to_zero(
    run_appliance: Any, tmp_path: Path, level: str
) -> None:
    repo = _gate_repository(tmp_path, model_limit=level == "model")
    options = {"max_queued_bytes": LIMIT} if level == "server" else {}
    srv = run_appliance(repo, **options)
    results: dict[int, Any] = {}

    def send(i: int) -> None:
        try:
            results[i] = _infer(srv.url, i + 1)
        except Exception as exc:  # reported by the asserts below
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    try:
        # the first executes (held at the gate), the second waits in the queue
        threads[0].start()
        wait_until(
            lambda: _pending_bytes(srv.metrics_url) == 4 * FLOATS, what="the first request held"
        )
        threads[1].start()
        wait_until(
            lambda: _pending_bytes(srv.metrics_url) == 8 * FLOATS, what="the second request held"
        )
        with pytest.raises(InferenceServerException) as refused:
            _infer(srv.url, 9)
        assert refused.value.status() == "503"
        assert "max_queued_bytes" in str(refused.value)
        # refused before the body is read: the headers alone get the answer
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=30) as s:
            s.sendall(
                b"POST /v2/models/gate/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
            )
            assert s.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        (repo / "gate" / "open").write_text("")
        for t in threads:
            t.join(120)
    for i in range(2):
        np.testing.assert_array_equal(results[i], np.full(FLOATS, i + 2, np.float32))
    wait_until(lambda: _pending_bytes(srv.metrics_url) == 0, what="the held bytes to be released")
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        text = r.read().decode()
    assert 'nv_inference_pending_request_bytes{model="gate",version="1"} 0' in text
    assert 'nv_inference_request_failure{model="gate",reason="REJECTED",version="1"} 2' in text
    assert _infer(srv.url, 5)[0] == 6  # serving goes on


# the snippet in the README's paragraph on overload (docs/overload.md): it must load
README_SNIPPET = """\
max_queued_bytes: 256MiB            # all models together; default: auto
max_queued_bytes_per_model: 128MiB  # each model; default: the server's
drain_timeout_s: 30                 # a bound only: shutdown lasts as long as the work
mqtt:
  host: 192.168.1.10
  max_pending: 64                   # announced to the broker as the v5 Receive Maximum
  reconnect_max_s: 2                # back within 1-2 s of the broker's return
"""


def test_readme_snippet_loads(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text(README_SNIPPET)
    config = load_server_config(path, {})
    assert config.max_queued_bytes == 256 * 2**20
    assert config.max_queued_bytes_per_model == 128 * 2**20
    assert config.mqtt is not None and config.mqtt.max_pending == 64
    assert config.mqtt.reconnect_max_s == 2.0 and config.mqtt.reconnect_min_s == 0.5


def test_after_a_burst_the_engines_hand_back_their_working_memory(
    run_appliance: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst of more than TRIM_AFTER_BYTES of requests, then a quiet second: the
    classifier's ONNX Runtime instance runs its smallest input with arena shrinkage,
    on its own thread (what the burst's big batches left is handed back before the
    heap is trimmed), and the model answers the same afterwards."""
    import shutil

    from appliance.core.queue_bytes import IDLE_S, TRIM_AFTER_BYTES

    shutil.copytree(Path(__file__).parents[2] / "appliance/demo_models/classifier", tmp_path / "c")
    srv = run_appliance(tmp_path)
    client = httpclient.InferenceServerClient(srv.url, concurrency=8)
    image = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)

    def infer(batch: np.ndarray) -> np.ndarray:
        tensor = httpclient.InferInput("input", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch, binary_data=True)
        return client.infer("c", [tensor]).as_numpy("output")

    before = infer(image)
    burst = np.repeat(image, 8, axis=0)  # 4.6 MiB a request: batches of 8-32 rows
    count = TRIM_AFTER_BYTES // burst.nbytes + 2
    with caplog.at_level(logging.DEBUG, logger="appliance.backends.onnxruntime_backend"):
        pending = [client.async_infer("c", [_input(burst)]) for _ in range(count)]
        for request in pending:
            assert request.get_result().as_numpy("output").shape == (8, 1000)
        handed = "the CPU arena handed back what it does not use"
        wait_until(lambda: handed in caplog.text, what="the arena handed back", timeout=20 * IDLE_S)
    (record,) = [r for r in caplog.records if handed in r.getMessage()]
    assert record.threadName.startswith("c#0")  # the instance's own thread
    np.testing.assert_array_equal(infer(image), before)
    client.close()


def _input(batch: np.ndarray) -> Any:
    tensor = httpclient.InferInput("input", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch, binary_data=True)
    return tensor
