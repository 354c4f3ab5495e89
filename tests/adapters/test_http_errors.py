"""Bad input over HTTP: each gets a precise status and {"error": ...}, and the server
keeps serving (every case is followed by a successful request)."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from devtools import modelgen

GOOD = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}


def post(
    url: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}
    finally:
        conn.close()


def assert_still_serving(url: str) -> None:
    status, doc = post(url, "/v2/models/simple/infer", json.dumps(GOOD).encode())
    assert status == 200, doc
    assert doc["outputs"][0]["data"] == [i + 1 for i in range(16)]


def binary_body(
    inputs: list[tuple[str, str, list[int], bytes]], lie: int = 0
) -> tuple[bytes, dict[str, str]]:
    """A tritonclient-style body; ``lie`` is added to the last binary_data_size."""
    header = {
        "inputs": [
            {
                "name": n,
                "datatype": dt,
                "shape": shape,
                "parameters": {"binary_data_size": len(raw) + (lie if i == len(inputs) - 1 else 0)},
            }
            for i, (n, dt, shape, raw) in enumerate(inputs)
        ]
    }
    head = json.dumps(header).encode()
    return head + b"".join(raw for *_, raw in inputs), {
        "Inference-Header-Content-Length": str(len(head))
    }


SIMPLE_BINARY = [
    ("INPUT0", "INT32", [1, 16], np.arange(16, dtype=np.int32).tobytes()),
    ("INPUT1", "INT32", [1, 16], np.ones(16, dtype=np.int32).tobytes()),
]


def _json_case(mutate) -> bytes:
    doc = json.loads(json.dumps(GOOD))
    mutate(doc)
    return json.dumps(doc).encode()


CASES = {
    "wrong shape": (
        400,
        "expected shape [-1, 16], got [1, 15]",
        _json_case(lambda d: d["inputs"][0].update(shape=[1, 15], data=list(range(15)))),
    ),
    "wrong dtype": (
        400,
        "expected datatype INT32, got FP32",
        _json_case(lambda d: d["inputs"][0].update(datatype="FP32")),
    ),
    "unknown input": (
        400,
        "has no input 'NOPE'",
        _json_case(lambda d: d["inputs"][0].update(name="NOPE")),
    ),
    "missing input": (
        400,
        (
            "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], "
            "but missing required input(s) ['INPUT1']. Please provide all required input(s)."
        ),
        _json_case(lambda d: d["inputs"].pop()),
    ),
    "data count": (
        400,
        "has 3 elements but shape [1, 16] needs 16",
        _json_case(lambda d: d["inputs"][0].update(data=[1, 2, 3])),
    ),
    "unknown datatype": (
        400,
        "unsupported datatype 'INT33'",
        _json_case(lambda d: d["inputs"][0].update(datatype="INT33")),
    ),
    "batch too large": (
        400,
        "batch size 9 is outside 1..8",
        _json_case(lambda d: [i.update(shape=[9, 16], data=[0] * 144) for i in d["inputs"]]),
    ),
    "unknown output": (
        400,
        "has no output 'OUT9'",
        _json_case(lambda d: d.update(outputs=[{"name": "OUT9"}])),
    ),
    "malformed json": (400, "malformed JSON", b'{"inputs": [}'),
    "not an object": (400, "must be a JSON object", b"[1, 2]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_json_requests(run_appliance, case: str) -> None:
    srv = run_appliance()
    status, message, body = CASES[case]
    got, doc = post(srv.url, "/v2/models/simple/infer", body)
    assert got == status
    assert message in doc["error"]
    assert_still_serving(srv.url)


def test_truncated_and_inconsistent_binary_bodies(run_appliance) -> None:
    srv = run_appliance()
    body, headers = binary_body(SIMPLE_BINARY)
    status, _ = post(srv.url, "/v2/models/simple/infer", body, headers)
    assert status == 200
    # truncated: the last tensor is cut short
    status, doc = post(srv.url, "/v2/models/simple/infer", body[:-10], headers)
    assert status == 400 and "truncated" in doc["error"]
    # sizes claim less than the body carries
    status, doc = post(srv.url, "/v2/models/simple/infer", body + b"\0" * 8, headers)
    assert status == 400 and "8 bytes of binary data follow the last input" in doc["error"]
    # a size that does not match the shape
    bad, bad_headers = binary_body(
        [*SIMPLE_BINARY[:1], ("INPUT1", "INT32", [1, 16], np.ones(15, dtype=np.int32).tobytes())]
    )
    status, doc = post(srv.url, "/v2/models/simple/infer", bad, bad_headers)
    assert status == 400 and "needs 64" in doc["error"]
    # header length beyond the body
    status, doc = post(
        srv.url,
        "/v2/models/simple/infer",
        body,
        {"Inference-Header-Content-Length": str(len(body) + 1)},
    )
    assert status == 400 and "Inference-Header-Content-Length" in doc["error"]
    assert_still_serving(srv.url)


def test_unknown_model_version_and_route(run_appliance) -> None:
    srv = run_appliance()
    body = json.dumps(GOOD).encode()
    status, doc = post(srv.url, "/v2/models/nope/infer", body)
    # Triton's status and text for both
    assert status == 400 and doc["error"] == "Request for unknown model: 'nope' is not found"
    status, doc = post(srv.url, "/v2/models/simple/versions/7/infer", body)
    assert status == 404 and "'simple' version 7 is not found" in doc["error"]
    status, doc = post(srv.url, "/v2/nothing/here", body)
    assert status == 404 and "error" in doc
    status, _ = post(srv.url, "/v2/models/simple/versions/1/infer", body)
    assert status == 200
    assert_still_serving(srv.url)


def test_oversized_payload(run_appliance) -> None:
    srv = run_appliance(max_request_size="64KiB")
    raw = np.zeros((1, 3, 224, 224), dtype=np.float32).tobytes()  # ~600 KB
    body, headers = binary_body([("input", "FP32", [1, 3, 224, 224], raw)])
    status, doc = post(srv.url, "/v2/models/classifier/infer", body, headers)
    assert status == 413 and "65536 bytes" in doc["error"]
    assert_still_serving(srv.url)


def _slow_queue_repo(tmp_path: Path, policy: str) -> Path:
    """simple with a long batching delay so requests sit in the queue."""
    modelgen.write_model(
        tmp_path,
        "simple",
        modelgen.simple_add_sub(),
        (
            "max_batch_size: 8\n"
            "dynamic_batching:\n"
            "  max_queue_delay_microseconds: 3000000\n"
            f"  default_queue_policy: {policy}\n"
        ),
    )
    return tmp_path


def test_queue_timeout_is_503(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_slow_queue_repo(tmp_path, "{default_timeout_microseconds: 100000}"))
    status, doc = post(srv.url, "/v2/models/simple/infer", json.dumps(GOOD).encode())
    assert status == 503 and doc["error"] == "Request timeout expired"  # Triton's text
    # a request may override the timeout (allow_timeout_override defaults to true); 8 rows
    # fill the batch so it runs without waiting for the delay
    full = _json_case(lambda d: [i.update(shape=[8, 16], data=[1] * 128) for i in d["inputs"]])
    status, doc = post(srv.url, "/v2/models/simple/infer", full)
    assert status == 200, doc


def test_full_queue_rejects_at_once_with_503(run_appliance, tmp_path: Path) -> None:
    srv = run_appliance(_slow_queue_repo(tmp_path, "{max_queue_size: 2}"))
    body = json.dumps(GOOD).encode()
    results: list[int] = []
    waiting = [
        threading.Thread(
            target=lambda: results.append(post(srv.url, "/v2/models/simple/infer", body)[0])
        )
        for _ in range(2)
    ]
    for t in waiting:
        t.start()
    pending = 'nv_inference_pending_request_count{model="simple",version="1"} 2'
    for _ in range(200):  # until both sit in the queue (bounded wait)
        if pending in urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode():
            break
        threading.Event().wait(0.01)
    else:
        pytest.fail("the two requests never showed as pending")
    status, doc = post(srv.url, "/v2/models/simple/infer", body)
    assert status == 503 and doc["error"] == "Exceeds maximum queue size"  # Triton's text
    for t in waiting:
        t.join(10)
    assert results == [200, 200]  # the queued ones were served, nothing lost
    stats = json.load(urllib.request.urlopen(f"http://{srv.url}/v2/models/simple/stats"))
    assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 1
