"""Triton's system shared-memory extension over HTTP, driven by the unmodified
tritonclient: register, infer with inputs and outputs in shared memory, status,
unregister; every error is a 400/404 followed by a successful normal request."""

from __future__ import annotations

import http.client
import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from appliance.adapters.codec import kserve
from appliance.errors import ApplianceError

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)
TENSOR = A.nbytes  # 64 bytes per [1, 16] INT32 tensor
_keys = itertools.count()


@pytest.fixture
def make_region() -> Iterator[Callable[[int], tuple[str, shm.SharedMemoryRegion]]]:
    """Creates POSIX shm objects with unique keys; destroys them all afterwards."""
    made: list[shm.SharedMemoryRegion] = []

    def make(byte_size: int) -> tuple[str, shm.SharedMemoryRegion]:
        key = f"/appliance_http_{os.getpid()}_{next(_keys)}"
        made.append(shm.create_shared_memory_region(key, key, byte_size))
        return key, made[-1]

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def contents(handle: shm.SharedMemoryRegion, offset: int = 0) -> np.ndarray:
    # a copy: a view would keep the client's mapping exported and block its close()
    return np.array(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=offset))


def shm_inputs(region: str, size0: int = TENSOR, offset0: int = 0) -> list[httpclient.InferInput]:
    """INPUT0 from ``region`` (default: its first 64 bytes), INPUT1 from the next 64."""
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, size0, offset=offset0)
    inputs[1].set_shared_memory(region, TENSOR, offset=TENSOR)
    return inputs


def assert_still_serving(client: httpclient.InferenceServerClient) -> None:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


def infer_error(client: httpclient.InferenceServerClient, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", *args, **kwargs)
    assert e.value.status() == "400", e.value.message()
    message = e.value.message()
    assert isinstance(message, str)
    return message


def post(url: str, path: str, body: bytes) -> tuple[int, Any]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}
    finally:
        conn.close()


def test_infer_with_inputs_and_outputs_in_shared_memory(run_appliance, make_region) -> None:
    srv = run_appliance(shared_memory="system")
    client = httpclient.InferenceServerClient(srv.url)
    assert "system_shared_memory" in client.get_server_metadata()["extensions"]
    in_key, in_handle = make_region(2 * TENSOR)
    out_key, out_handle = make_region(2 * TENSOR)
    shm.set_shared_memory_region(in_handle, [A, B])
    client.unregister_system_shared_memory()  # what Triton's examples do first
    client.register_system_shared_memory("in", in_key, 2 * TENSOR)
    client.register_system_shared_memory("out", out_key, 2 * TENSOR)

    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0"),
        httpclient.InferRequestedOutput("OUTPUT1"),
    ]
    outputs[0].set_shared_memory("out", TENSOR)
    outputs[1].set_shared_memory("out", TENSOR, offset=TENSOR)
    result = client.infer("simple", shm_inputs("in"), outputs=outputs, request_id="r1")
    np.testing.assert_array_equal(contents(out_handle), A + B)
    np.testing.assert_array_equal(contents(out_handle, TENSOR), A - B)
    # Triton's response: name, datatype and shape only (no data, no parameters)
    out1 = result.get_output("OUTPUT1")
    assert out1 == {"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16]}
    assert result.get_response()["id"] == "r1"

    # mixed: one input in shared memory and one binary, one output each way
    shm.set_shared_memory_region(in_handle, [B * 5], offset=TENSOR)
    inputs = shm_inputs("in")
    inputs[0].set_data_from_numpy(A)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0"),
        httpclient.InferRequestedOutput("OUTPUT1"),
    ]
    outputs[1].set_shared_memory("out", TENSOR)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B * 5)
    np.testing.assert_array_equal(contents(out_handle), A - B * 5)

    status = client.get_system_shared_memory_status()
    assert sorted(status, key=lambda r: r["name"]) == [
        {"name": "in", "key": in_key, "offset": 0, "byte_size": 2 * TENSOR},
        {"name": "out", "key": out_key, "offset": 0, "byte_size": 2 * TENSOR},
    ]
    assert client.get_system_shared_memory_status("out") == [
        {"name": "out", "key": out_key, "offset": 0, "byte_size": 2 * TENSOR}
    ]
    client.unregister_system_shared_memory("in")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    assert "Unable to find shared memory region: 'in'" in infer_error(client, shm_inputs("in"))
    assert_still_serving(client)


def test_region_with_an_offset_into_the_object(run_appliance, make_region) -> None:
    srv = run_appliance(shared_memory="system")
    client = httpclient.InferenceServerClient(srv.url)
    key, handle = make_region(8192 + 4 + 2 * TENSOR)  # a window past a page boundary
    shm.set_shared_memory_region(handle, [A, B], offset=8192 + 4)
    client.register_system_shared_memory("w", key, 2 * TENSOR + 4, offset=8192)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory("w", TENSOR, offset=4)
    inputs[1].set_shared_memory("w", TENSOR, offset=4 + TENSOR)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_errors_each_followed_by_a_good_request(run_appliance, make_region) -> None:
    srv = run_appliance(shared_memory="system")
    client = httpclient.InferenceServerClient(srv.url)
    in_key, in_handle = make_region(2 * TENSOR)
    out_key, _ = make_region(2 * TENSOR)
    shm.set_shared_memory_region(in_handle, [A, B])
    client.register_system_shared_memory("in", in_key, 2 * TENSOR)
    client.register_system_shared_memory("tiny", out_key, TENSOR // 2)
    client.register_system_shared_memory("out", out_key, 2 * TENSOR)

    def out0(region: str, byte_size: int, offset: int = 0) -> list[Any]:
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(region, byte_size, offset=offset)
        return [output]

    cases = {
        "unknown input region": (
            lambda: infer_error(client, shm_inputs("nope")),
            "input 'INPUT0': Unable to find shared memory region: 'nope'",
        ),
        "input offset out of bounds": (
            lambda: infer_error(client, shm_inputs("in", offset0=100)),
            "input 'INPUT0': Invalid offset + byte size for shared memory region: 'in' "
            "(offset 100 + byte_size 64 is outside its 128 bytes)",
        ),
        "input byte size past the region": (
            lambda: infer_error(client, shm_inputs("in", size0=2 * TENSOR + 1)),
            "Invalid offset + byte size for shared memory region: 'in'",
        ),
        "input byte size wrong for the shape": (
            lambda: infer_error(client, shm_inputs("in", size0=TENSOR - 4)),
            "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60",
        ),
        "unknown output region": (
            lambda: infer_error(client, shm_inputs("in"), outputs=out0("nope", TENSOR)),
            "output 'OUTPUT0': Unable to find shared memory region: 'nope'",
        ),
        "output window past a small region": (
            lambda: infer_error(client, shm_inputs("in"), outputs=out0("tiny", TENSOR)),
            "output 'OUTPUT0': Invalid offset + byte size for shared memory region: 'tiny' "
            "(offset 0 + byte_size 64 is outside its 32 bytes)",
        ),
        "output byte size too small": (
            lambda: infer_error(client, shm_inputs("in"), outputs=out0("out", TENSOR // 2)),
            "output 'OUTPUT0': needs 64 bytes but shared_memory_byte_size is 32 in region 'out'",
        ),
        "output offset out of bounds": (
            lambda: infer_error(client, shm_inputs("in"), outputs=out0("out", TENSOR, 2 * TENSOR)),
            "Invalid offset for shared memory region: 'out'",
        ),
    }
    for case, (call, expected) in cases.items():
        assert expected in call(), case
        assert_still_serving(client)

    with pytest.raises(InferenceServerException) as e:
        client.get_system_shared_memory_status("nope")
    assert e.value.status() == "404"
    assert e.value.message() == "Unable to find system shared memory region: 'nope'"
    client.unregister_system_shared_memory("nope")  # a no-op, as in Triton


def test_bad_shared_memory_parameters(run_appliance, make_region) -> None:
    srv = run_appliance(shared_memory="system")
    key, _ = make_region(2 * TENSOR)
    client = httpclient.InferenceServerClient(srv.url)
    client.register_system_shared_memory("in", key, 2 * TENSOR)
    good = {"shared_memory_region": "in", "shared_memory_byte_size": TENSOR}
    cases = [
        ({**good, "shared_memory_region": 3}, "'shared_memory_region' must be a non-empty string"),
        ({"shared_memory_region": "in"}, "need 'shared_memory_byte_size'"),
        ({**good, "shared_memory_byte_size": "64"}, "'shared_memory_byte_size' must be a non-"),
        ({**good, "shared_memory_offset": -4}, "'shared_memory_offset' must be a non-negative"),
        ({**good, "shared_memory_offset": True}, "'shared_memory_offset' must be a non-negative"),
        ({**good, "binary_data_size": TENSOR}, "has shared-memory parameters and also carries"),
    ]
    for params, expected in cases:
        doc = {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": params},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "parameters": good},
            ]
        }
        status, body = post(srv.url, "/v2/models/simple/infer", orjson.dumps(doc))
        assert status == 400 and expected in body["error"], (params, body)
    doc["outputs"] = [{"name": "OUTPUT0", "parameters": {**good, "classification": 2}}]
    doc["inputs"][0]["parameters"] = good
    status, body = post(srv.url, "/v2/models/simple/infer", orjson.dumps(doc))
    assert status == 400 and "classification output cannot go to shared memory" in body["error"]
    assert_still_serving(client)


def test_register_validation(run_appliance, make_region) -> None:
    srv = run_appliance(shared_memory="system")
    key, _ = make_region(TENSOR)
    path = "/v2/systemsharedmemory/region/r/register"
    cases = [
        (b"{", "malformed JSON"),
        (b"[]", "must be a JSON object"),
        (b"", "needs a 'key' string"),
        (orjson.dumps({"key": 7, "byte_size": 8}), "needs a 'key' string"),
        (orjson.dumps({"key": key}), "needs 'byte_size'"),
        (orjson.dumps({"key": key, "byte_size": "8"}), "'byte_size' must be a non-negative"),
        (orjson.dumps({"key": key, "byte_size": 8, "offset": -1}), "'offset' must be a non-neg"),
        (orjson.dumps({"key": key, "byte_size": 8, "offset": 1.5}), "'offset' must be a non-neg"),
        (orjson.dumps({"key": key, "byte_size": 0}), "byte_size an integer > 0"),
        (orjson.dumps({"key": key, "byte_size": TENSOR + 1}), f"exceeds the {TENSOR} bytes"),
        (orjson.dumps({"key": "/a/b", "byte_size": 8}), "is not a POSIX shared-memory name"),
        (orjson.dumps({"key": "/", "byte_size": 8}), "'r' - invalid shm key '/'"),
    ]
    for body, expected in cases:
        status, doc = post(srv.url, path, body)
        assert status == 400 and expected in doc["error"], (body, doc)
    # Triton answers INTERNAL for a key it cannot open
    status, doc = post(srv.url, path, orjson.dumps({"key": f"/nope_{os.getpid()}", "byte_size": 8}))
    assert status == 500 and doc["error"].startswith("Unable to open shared memory region: ")
    client = httpclient.InferenceServerClient(srv.url)
    assert client.get_system_shared_memory_status() == []
    client.register_system_shared_memory("r", key, TENSOR)
    with pytest.raises(InferenceServerException, match="'r' already in manager"):
        client.register_system_shared_memory("r", key, 8)
    assert client.get_system_shared_memory_status("r")[0]["byte_size"] == TENSOR
    assert_still_serving(client)


def test_unregister_while_a_request_holds_the_region(run_appliance, make_region) -> None:
    """A decoded request keeps viewing the mapping after its region is unregistered
    (decoded here without a ticket, so it holds no region: see
    tests/test_triton_qa_cases.py for a request that holds its regions)."""
    srv = run_appliance(shared_memory="system")
    key, handle = make_region(2 * TENSOR)
    shm.set_shared_memory_region(handle, [A, B])
    registry = srv.server.dataplane.shared_memory
    client = httpclient.InferenceServerClient(srv.url)
    client.register_system_shared_memory("in", key, 2 * TENSOR)
    params = {"shared_memory_region": "in", "shared_memory_byte_size": TENSOR}
    doc = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": params},
            {
                "name": "INPUT1",
                "datatype": "INT32",
                "shape": [1, 16],
                "parameters": {**params, "shared_memory_offset": TENSOR},
            },
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {**params, "shared_memory_offset": 0}}],
    }
    request, fmt = kserve.decode_request(orjson.dumps(doc), None, "simple", "", registry)
    client.unregister_system_shared_memory()  # mid-flight: the inputs still view the mapping
    response = srv.call(srv.server.dataplane.infer(request))
    np.testing.assert_array_equal(response.outputs["OUTPUT0"], A + B)
    with pytest.raises(ApplianceError, match="Unable to find shared memory region: 'in'"):
        kserve.encode_response(response, fmt, registry)  # its output region is gone
    del request, response
    assert_still_serving(client)


def test_disabled_by_default(run_appliance, make_region) -> None:
    srv = run_appliance()
    client = httpclient.InferenceServerClient(srv.url)
    key, handle = make_region(2 * TENSOR)
    shm.set_shared_memory_region(handle, [A, B])
    assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
    enable = "set 'shared_memory: system' in the server config"
    calls: list[Callable[[], object]] = [
        lambda: client.register_system_shared_memory("in", key, 2 * TENSOR),
        lambda: client.get_system_shared_memory_status(),
        lambda: client.unregister_system_shared_memory(),
        lambda: client.infer("simple", shm_inputs("in")),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "400"
        assert enable in e.value.message()
        assert_still_serving(client)
    # an output bound for shared memory is refused before the model runs
    outputs = [httpclient.InferRequestedOutput("OUTPUT0")]
    outputs[0].set_shared_memory("out", TENSOR)
    inputs = shm_inputs("in")
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    assert enable in infer_error(client, inputs, outputs=outputs)
    assert_still_serving(client)
