"""Attack class: requests whose declarations lie about their size, and odd credentials.

Shapes that overflow, exceed numpy's rank, or promise millions of elements the
model would refuse anyway must be answered 400 / INVALID_ARGUMENT before any
array exists, over HTTP (JSON and binary forms) and gRPC; bytes in an
``Authorization`` header that are not text, and a second ``Authorization``,
must be answered 401 / UNAUTHENTICATED. The ``run_appliance`` fixture fails any
of these tests if a request blocked the event loop.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from appliance.adapters.codec import kserve
from appliance.adapters.grpc import codec
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError

HUGE = 4611686018427387904  # 2**62


def _post(port: int, path: str, body: bytes, headers: list[tuple[str, bytes]] | None = None
          ) -> tuple[int, dict[str, Any] | None]:
    """POST over http.client, whose putheader sends bytes values as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Length", str(len(body)))
        for key, value in headers or []:
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    return response.status, json.loads(raw) if raw else None


def _json_infer(shape: list[int], data: list[Any], datatype: str = "INT32") -> bytes:
    inputs = [{"name": n, "datatype": datatype, "shape": shape, "data": data}
              for n in ("INPUT0", "INPUT1")]
    return json.dumps({"inputs": inputs}).encode()


def _binary_infer(tensors: list[tuple[str, str, list[int], bytes]]) -> tuple[bytes, int]:
    header = json.dumps({"inputs": [
        {"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
        for n, d, s, b in tensors
    ]}).encode()
    return header + b"".join(b for *_, b in tensors), len(header)


OVERSIZED_SHAPES = [
    pytest.param([0, HUGE], id="zero-times-2**62"),
    pytest.param([HUGE, 0], id="2**62-times-zero"),
    pytest.param([1] * 65, id="rank-65"),
    pytest.param([2**32, 2**32], id="overflows-int64-bytes"),
    pytest.param([2**63 - 1], id="int64-max"),
]


@pytest.mark.parametrize("shape", OVERSIZED_SHAPES)
def test_codecs_refuse_impossible_shapes_before_any_array(shape: list[int]) -> None:
    for body, length in (
        (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape,
                                 "data": []}]}).encode(), None),
        _binary_infer([("x", "FP32", shape, b"")]),
        _binary_infer([("x", "BYTES", shape, b"")]),
    ):
        with pytest.raises(ApplianceError) as info:
            kserve.decode_request(body, length, "m", "")
        assert "shape" in info.value.message
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="FP32", shape=shape)
    msg.raw_input_contents.append(b"")
    with pytest.raises(ApplianceError, match="shape"):
        codec.decode_request(msg, SharedMemoryRegistry(enabled=False))


def test_grpc_codec_refuses_narrow_integers_out_of_range() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    tensor = msg.inputs.add(name="x", datatype="INT8", shape=[2])
    tensor.contents.int_contents.extend([1, 300])
    with pytest.raises(ApplianceError, match="outside the INT8 range"):
        codec.decode_request(msg, SharedMemoryRegistry(enabled=False))


@pytest.mark.parametrize("shape", OVERSIZED_SHAPES)
def test_http_and_grpc_answer_impossible_shapes_with_400(
    run_appliance: Any, shape: list[int]
) -> None:
    srv = run_appliance()
    port = srv.server.http_port
    count = 1 if shape == [1] * 65 else 0  # data that matches the shape's element count
    status, body = _post(port, "/v2/models/simple/infer", _json_infer(shape, [0] * count))
    assert status == 400 and "shape" in body["error"], body
    data = b"\0\0\0\0" * count
    binary, length = _binary_infer([(n, "INT32", shape, data) for n in ("INPUT0", "INPUT1")])
    status, body = _post(port, "/v2/models/simple/infer", binary,
                         [("Inference-Header-Content-Length", str(length).encode())])
    assert status == 400 and "shape" in body["error"], body
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        msg = service_pb2.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            msg.inputs.add(name=name, datatype="INT32", shape=shape)
            msg.raw_input_contents.append(data)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(msg)
        error: Any = info.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in error.details()


def test_element_cap_per_request(run_appliance: Any) -> None:
    srv = run_appliance(max_request_elements=64)
    port = srv.server.http_port
    status, body = _post(port, "/v2/models/simple/infer", _json_infer([3, 16], [0] * 48))
    assert status == 400 and "max_request_elements" in body["error"], body
    status, body = _post(port, "/v2/models/simple/infer", _json_infer([2, 16], [0] * 32))
    assert status == 200, body


def _zero_length_strings(count: int) -> bytes:
    return b"\0\0\0\0" * count  # each element: a 4-byte length of 0


def test_a_bytes_flood_is_refused_against_the_models_batch_bound(run_appliance: Any) -> None:
    """The reported case: 15,000,000 zero-length strings (60 MB) to image_classifier."""
    srv = run_appliance()
    count = 15_000_000
    data = _zero_length_strings(count)
    binary, length = _binary_infer([("IMAGE", "BYTES", [count, 1], data)])
    del data
    status, body = _post(srv.server.http_port, "/v2/models/image_classifier/infer", binary,
                         [("Inference-Header-Content-Length", str(length).encode())])
    assert status == 400, body
    assert "batch size 15000000 is outside 1..8" in body["error"]
    del binary
    # over gRPC the message is parsed by grpc before any handler runs (a 60 MB parse is
    # its own cost, bounded by max_request_size): the declaration is what is tested here
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        msg = service_pb2.ModelInferRequest(model_name="image_classifier")
        msg.inputs.add(name="IMAGE", datatype="BYTES", shape=[count, 1])
        msg.raw_input_contents.append(_zero_length_strings(250_000))
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(msg)
        error: Any = info.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch size 15000000 is outside 1..8" in error.details()


def test_many_bytes_elements_within_the_model_bounds_are_served(
    run_appliance: Any, test_repository: Path
) -> None:
    """Decoded off the event loop (one Python object per element): the fixture's
    blocking detector fails the test otherwise."""
    srv = run_appliance(test_repository)
    count = 200_000
    binary, length = _binary_infer([("INPUT0", "BYTES", [1, count], _zero_length_strings(count))])
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=120)
    doc = json.loads(binary[:length])
    doc["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]
    header = json.dumps(doc).encode()
    conn.request("POST", "/v2/models/identity_bytes/infer", header + binary[length:],
                 {"Inference-Header-Content-Length": str(len(header))})
    response = conn.getresponse()
    out = response.read()
    conn.close()
    assert response.status == 200, out[:300]
    size = int(response.headers["Inference-Header-Content-Length"])
    reply = json.loads(out[:size])
    assert reply["outputs"][0]["shape"] == [1, count]
    assert out[size:] == _zero_length_strings(count)


# ---- credentials ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        pytest.param([b"Bearer \xff\xfe"], id="not-utf8"),
        pytest.param([b"Bearer s3cr\xc3\xa9t"], id="utf8-lookalike"),
        pytest.param([b"Bearer s3cret", b"Bearer s3cret"], id="two-right-headers"),
        pytest.param([b"Bearer wrong", b"Bearer s3cret"], id="wrong-then-right"),
        pytest.param([b"Bearer s3cret", b"Bearer wrong"], id="right-then-wrong"),
        pytest.param([b"Basic czNjcmV0"], id="other-scheme"),
    ],
)
def test_bad_authorization_headers_are_401(run_appliance: Any, values: list[bytes]) -> None:
    srv = run_appliance(admin_token="s3cret", inference_token="inf")
    port = srv.server.http_port
    for path in ("/v2/repository/models/simple/load", "/v2/models/simple/infer"):
        status, body = _post(port, path, b"{}", [("Authorization", v) for v in values])
        assert status == 401, (path, body)
        assert body and body["error"]
    status, _ = _post(port, "/v2/repository/models/simple/load", b"{}",
                      [("Authorization", b"Bearer s3cret")])
    assert status == 200


def test_grpc_refuses_two_authorization_entries(run_appliance: Any) -> None:
    srv = run_appliance(admin_token="s3cret")
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        load = service_pb2.RepositoryModelLoadRequest(model_name="simple")
        for metadata in (
            [("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")],
            [("authorization", "Bearer nope"), ("authorization", "Bearer s3cret")],
            [("authorization", "Bearer s3cret"), ("authorization", "Bearer nope")],
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.RepositoryModelLoad(load, metadata=metadata)
            error: Any = info.value
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "exactly one" in error.details()
        stub.RepositoryModelLoad(load, metadata=[("authorization", "Bearer s3cret")])


def test_gate_refusals_count_as_model_failures(run_appliance: Any) -> None:
    srv = run_appliance()
    port = srv.server.http_port
    status, _ = _post(port, "/v2/models/simple/infer", _json_infer([9, 16], [0] * 144))
    assert status == 400  # batch size 9 > max_batch_size 8
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v2/models/simple/stats")
    stats = json.loads(conn.getresponse().read())
    conn.close()
    assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 1
