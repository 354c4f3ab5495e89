"""Queue policies and the rate limiter end to end: a real server on 127.0.0.1, HTTP and
gRPC clients, and a Python model that holds each call (of an input other than 0, which
the load's warm-up probe sends) until the test opens its gate (a file), so requests
wait in the queue for as long as the test needs. Every wait is bounded; the tests
assert outcomes (answers, errors, the order the model ran requests in), never
durations."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

BOUND_S = 60.0  # the longest any wait may take; reached only when a test is failing

GATED_MODEL = """\
import json
import os
import time

import numpy as np

from appliance import python_model as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.gate = params["gate"]["string_value"]
        self.log = params["log"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            value = float(x.ravel()[0])
            if value:  # (0: the server's warm-up probe at load, answered at once)
                with open(self.log, "a") as f:
                    f.write(f"{value:g}\\n")
            end = time.monotonic() + 60
            while value and not os.path.exists(self.gate):
                if time.monotonic() > end:
                    raise RuntimeError("the test never opened the gate")
                time.sleep(0.005)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
"""

CONFIG = """\
backend: python
max_batch_size: 1
input:
  - {name: INPUT0, data_type: TYPE_FP32, dims: [1]}
output:
  - {name: OUTPUT0, data_type: TYPE_FP32, dims: [1]}
parameters:
  gate: {string_value: "GATE"}
  log: {string_value: "LOG"}
"""


class Gated:
    """A gated model's folder, gate and log of the inputs it ran, in order."""

    def __init__(self, repo: Path, name: str, extra: str) -> None:
        self.name = name
        self.gate = repo / f"{name}.gate"
        self.log = repo / f"{name}.log"
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(GATED_MODEL)
        config = CONFIG.replace("GATE", str(self.gate)).replace("LOG", str(self.log))
        (folder / "config.yaml").write_text(config + extra)

    def ran(self) -> list[float]:
        return [float(v) for v in self.log.read_text().split()] if self.log.exists() else []

    def open(self) -> None:
        self.gate.touch()


def until(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"never: {what}")
        time.sleep(0.005)


def queue_of(srv: Any, model: str) -> Any:
    """The model's dynamic batcher, read to know when the server reached a state."""
    return srv.server.lifecycle.get(model).scheduler


def nothing_held(srv: Any) -> bool:
    """Every request's queued-bytes hold was released: refused, timed out, delayed and
    served requests alike (no bytes held, no request holding)."""
    queued = srv.server.dataplane.queued
    return queued.held == 0 and queued.holding == 0


def http_infer(srv: Any, model: str, value: float, **params: Any) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [value]}]
    }
    if params:
        body["parameters"] = params
    request = urllib.request.Request(
        f"http://{srv.url}/v2/models/{model}/infer",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class InBackground:
    """Calls made on threads; their results once joined (bounded)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: dict[str, Any] = {}

    def call(self, key: str, fn: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                self.results[key] = fn()
            except Exception as exc:  # an expected error is a result too
                self.results[key] = exc

        thread = threading.Thread(target=run, name=f"client-{key}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> dict[str, Any]:
        for thread in self.threads:
            thread.join(BOUND_S)
            assert not thread.is_alive(), f"{thread.name} never returned"
        return self.results


def grpc_infer(srv: Any, model: str, value: float, **kwargs: Any) -> np.ndarray:
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        data = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        data.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        result = client.infer(model, [data], client_timeout=BOUND_S, **kwargs)
        return result.as_numpy("OUTPUT0")
    finally:
        client.close()


def test_a_full_queue_refuses_at_once_with_tritons_503_and_unavailable(
    run_appliance, tmp_path: Path
) -> None:
    model = Gated(
        tmp_path, "gated", "dynamic_batching: {default_queue_policy: {max_queue_size: 2}}\n"
    )
    srv = run_appliance(tmp_path)
    calls = InBackground()
    calls.call("10", lambda: http_infer(srv, "gated", 10))
    until(lambda: model.ran() == [10.0], "the first request runs")
    for v in (1, 2):  # one after the other: their order in the queue is known
        calls.call(str(v), lambda v=v: http_infer(srv, "gated", v))
        until(lambda v=v: queue_of(srv, "gated").pending == v, f"{v} request(s) queued")
    status, doc = http_infer(srv, "gated", 3)  # answered while the others still wait
    assert status == 503 and doc == {"error": "Exceeds maximum queue size"}
    with pytest.raises(InferenceServerException) as info:  # gRPC: Triton's status too
        grpc_infer(srv, "gated", 4, request_id="r4")
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert info.value.message() == "[request id: r4] Exceeds maximum queue size"
    model.open()
    results = calls.join()
    assert [results[k][0] for k in ("10", "1", "2")] == [200, 200, 200]
    assert model.ran() == [10.0, 1.0, 2.0]  # the refused one never ran
    until(lambda: nothing_held(srv), "every hold released")


def test_grpc_a_late_request_under_reject_is_unavailable_request_timeout_expired(
    run_appliance, tmp_path: Path
) -> None:
    model = Gated(
        tmp_path,
        "gated",
        "dynamic_batching: {default_queue_policy: {default_timeout_microseconds: 60000000}}\n",
    )
    srv = run_appliance(tmp_path)
    calls = InBackground()
    calls.call("first", lambda: grpc_infer(srv, "gated", 10))
    until(lambda: model.ran() == [10.0], "the first request runs")
    # the instance is held until the answer below came back: the timeout must pass first
    with pytest.raises(InferenceServerException) as info:
        grpc_infer(srv, "gated", 1, timeout=1000)  # a shorter timeout (µs) of its own
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert info.value.message() == "Request timeout expired"
    model.open()
    assert calls.join()["first"].tolist() == [[10.0]]
    assert model.ran() == [10.0]
    # the longer default stays a request's bound: it is served
    assert grpc_infer(srv, "gated", 2, timeout=120_000_000).tolist() == [[2.0]]
    until(lambda: nothing_held(srv), "every hold released")


DELAY_POLICY = """\
dynamic_batching:
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy:
    timeout_action: DELAY
    default_timeout_microseconds: 60000000
    allow_timeout_override: true
"""


@pytest.mark.parametrize("wire", ["http", "grpc"])
def test_delay_serves_a_late_request_after_its_level_and_priority_first(
    run_appliance, tmp_path: Path, wire: str
) -> None:
    model = Gated(tmp_path, "gated", DELAY_POLICY)
    srv = run_appliance(tmp_path)
    batcher = queue_of(srv, "gated")

    def infer(value: float, **params: Any) -> Any:
        if wire == "http":
            return http_infer(srv, "gated", value, **params)
        return grpc_infer(srv, "gated", value, **params)

    calls = InBackground()
    calls.call("10", lambda: infer(10))
    until(lambda: model.ran() == [10.0], "the first request runs")
    calls.call("late", lambda: infer(1, timeout=1000))  # times out while queued
    until(lambda: batcher.pending == 1 and batcher._queue[0].delayed, "the late one delayed")
    calls.call("level2", lambda: infer(2))
    until(lambda: batcher.pending == 2, "the level-2 request queued")
    calls.call("level1", lambda: infer(3, priority=1))
    until(lambda: batcher.pending == 3, "the level-1 request queued")
    model.open()
    results = calls.join()
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    assert model.ran() == [10.0, 3.0, 2.0, 1.0]  # level 1, level 2, then the late one
    until(lambda: nothing_held(srv), "every hold released")


RATE_LIMITED = """\
instance_group:
  - count: 1
    kind: KIND_CPU
    rate_limiter:
      resources: [{name: npu, count: 1, global: true}]
"""


def test_two_models_sharing_a_global_resource_never_run_together(
    run_appliance, tmp_path: Path
) -> None:
    first = Gated(tmp_path, "first", RATE_LIMITED)
    second = Gated(tmp_path, "second", RATE_LIMITED)
    second.open()  # second runs at once whenever it holds the npu
    srv = run_appliance(tmp_path, rate_limit="execution_count", rate_limit_resources=["npu:1"])
    calls = InBackground()
    calls.call("first", lambda: http_infer(srv, "first", 1))
    until(lambda: first.ran() == [1.0], "first runs, holding the npu")
    calls.call("second", lambda: grpc_infer(srv, "second", 2))
    waiting = queue_of(srv, "second")
    until(lambda: waiting._tickets[0].staged, "second has a batch and waits for the npu")
    assert second.ran() == []  # it cannot have run: first still holds the only npu
    first.open()
    results = calls.join()
    assert results["first"][0] == 200 and results["second"].tolist() == [[2.0]]
    assert second.ran() == [2.0]


def test_a_model_needing_more_than_exists_fails_to_load_with_tritons_text(
    run_appliance, tmp_path: Path
) -> None:
    Gated(tmp_path, "big", RATE_LIMITED.replace("count: 1, global", "count: 2, global"))
    fits = Gated(tmp_path, "fits", RATE_LIMITED)
    fits.open()
    srv = run_appliance(tmp_path, rate_limit="execution_count", rate_limit_resources=["npu:1"])
    request = urllib.request.Request(f"http://{srv.url}/v2/repository/index", b"{}")
    with urllib.request.urlopen(request, timeout=BOUND_S) as reply:
        index = {m["name"]: m for m in json.loads(reply.read())}
    assert index["big"]["state"] == "UNAVAILABLE"
    assert 'Resource count for "npu" is limited to 1' in index["big"]["reason"]
    assert index["fits"]["state"] == "READY"
    status, doc = http_infer(srv, "fits", 5)
    assert status == 200 and doc["outputs"][0]["data"] == [5.0]
