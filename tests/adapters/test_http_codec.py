"""KServe v2 HTTP body codec: JSON, Triton's binary tensor extension, errors."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest

from appliance.adapters.codec.kserve import (
    HEADER_LENGTH,
    OutputFormat,
    decode_request,
    encode_response,
    error_body,
    parse_header_length,
    parse_request,
)
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceResponse


def binary_body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, int]:
    """What tritonclient sends: JSON header, then raw tensor bytes; the length goes apart."""
    json_part = orjson.dumps(header)
    return json_part + b"".join(chunks), len(json_part)


def decode(doc: Any, model: str = "m", version: str = "") -> Any:
    return decode_request(orjson.dumps(doc), None, model, version)


def decode_error(body: bytes, header_length: int | None = None) -> str:
    with pytest.raises(ApplianceError) as e:
        decode_request(body, header_length, "m", "")
    assert e.value.code is Code.INVALID_ARG
    return str(e.value)


def json_error(doc: Any) -> str:
    return decode_error(orjson.dumps(doc))


def lp(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def split(body: bytes, header_length: int | None) -> tuple[dict[str, Any], bytes]:
    end = len(body) if header_length is None else header_length
    return orjson.loads(body[:end]), body[end:]


# ---- decode: JSON -------------------------------------------------------------------


def test_decode_pure_json() -> None:
    request, fmt = decode(
        {
            "id": "req-7",
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [[1, 2, 3.5]]},
                {"name": "INPUT1", "datatype": "INT64", "shape": [3], "data": [4, 5, 6]},
            ],
        },
        model="simple",
        version="2",
    )
    assert request.model_name == "simple" and request.model_version == "2"
    assert request.id == "req-7"
    assert list(request.inputs) == ["INPUT0", "INPUT1"]
    x = request.inputs["INPUT0"]
    assert x.dtype == np.float32 and x.shape == (1, 3) and x.tolist() == [[1, 2, 3.5]]
    assert request.inputs["INPUT1"].dtype == np.int64
    assert request.outputs == () and request.timeout_us is None and request.classification == {}
    assert not fmt.is_binary("anything")


def test_decode_bytes_json_input() -> None:
    request, _ = decode(
        {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["hi", ""]}]}
    )
    assert request.inputs["s"].tolist() == [b"hi", b""]


# ---- decode: binary extension -------------------------------------------------------


def test_decode_binary_input_is_a_view_of_the_body() -> None:
    tensor = np.arange(6, dtype=np.float32).reshape(2, 3)
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [2, 3],
                    "parameters": {"binary_data_size": tensor.nbytes},
                }
            ]
        },
        tensor.tobytes(),
    )
    request, _ = decode_request(body, length, "m", "")
    x = request.inputs["x"]
    np.testing.assert_array_equal(x, tensor)
    assert np.shares_memory(x, np.frombuffer(body, dtype=np.uint8))


def test_decode_multiple_binary_inputs_in_order() -> None:
    a = np.array([1, 2, 3], dtype=np.int32)
    b = np.array([[0.5], [1.5]], dtype=np.float64)
    c = np.array([True, False])
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "a",
                    "datatype": "INT32",
                    "shape": [3],
                    "parameters": {"binary_data_size": a.nbytes},
                },
                {"name": "json", "datatype": "UINT8", "shape": [1], "data": [9]},
                {
                    "name": "b",
                    "datatype": "FP64",
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": b.nbytes},
                },
                {
                    "name": "c",
                    "datatype": "BOOL",
                    "shape": [2],
                    "parameters": {"binary_data_size": c.nbytes},
                },
            ]
        },
        a.tobytes(),
        b.tobytes(),
        c.tobytes(),
    )
    request, _ = decode_request(body, length, "m", "")
    assert list(request.inputs) == ["a", "json", "b", "c"]
    assert request.inputs["a"].tolist() == [1, 2, 3]
    assert request.inputs["json"].tolist() == [9]
    assert request.inputs["b"].tolist() == [[0.5], [1.5]]
    assert request.inputs["c"].tolist() == [True, False]


def test_decode_bytes_binary_input() -> None:
    raw = lp(b"one", b"", b"\xff\x00")
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [1, 3],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        },
        raw,
    )
    request, _ = decode_request(body, length, "m", "")
    assert request.inputs["s"].tolist() == [[b"one", b"", b"\xff\x00"]]


def test_decode_output_options() -> None:
    request, fmt = decode(
        {
            "id": "abc",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
            "outputs": [
                {"name": "probs", "parameters": {"classification": 3}},
                {"name": "raw", "parameters": {"binary_data": True}},
                {"name": "plain"},
            ],
            "parameters": {"binary_data_output": False, "timeout": 2500},
        }
    )
    assert request.outputs == ("probs", "raw", "plain")
    assert request.classification == {"probs": 3}
    assert request.timeout_us == 2500
    assert request.id == "abc"
    assert fmt.is_binary("raw") and not fmt.is_binary("probs") and not fmt.is_binary("plain")


def test_decode_binary_data_output_is_the_default() -> None:
    _, fmt = decode(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
            "outputs": [{"name": "json_one", "parameters": {"binary_data": False}}],
            "parameters": {"binary_data_output": True},
        }
    )
    assert fmt.is_binary("unlisted")
    assert not fmt.is_binary("json_one")


# ---- decode: malformed requests -----------------------------------------------------

X = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}


def test_not_json() -> None:
    assert "malformed JSON" in decode_error(b"{not json")


def test_json_not_an_object() -> None:
    assert "must be a JSON object" in json_error([X])


@pytest.mark.parametrize("doc", [{}, {"inputs": {"x": 1}}])
def test_missing_inputs(doc: dict[str, Any]) -> None:
    assert "the request must have an 'inputs' list" in json_error(doc)


def test_no_inputs_is_a_request_for_a_model_whose_inputs_are_all_optional() -> None:
    form = parse_request(b'{"inputs": []}', None, "m", "")
    assert form.inputs == []


def test_input_not_an_object() -> None:
    assert "inputs[0] must be an object" in json_error({"inputs": ["x"]})


def test_input_without_name() -> None:
    assert "inputs[1] needs a 'name'" in json_error(
        {"inputs": [X, {"datatype": "FP32", "shape": [1], "data": [1]}]}
    )


def test_input_without_datatype() -> None:
    msg = json_error({"inputs": [{"name": "x", "shape": [1], "data": [1]}]})
    assert "input 'x' needs a 'datatype'" in msg


def test_input_without_shape() -> None:
    msg = json_error({"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]})
    assert "input 'x'" in msg and "'shape' must be a list of non-negative integers" in msg


@pytest.mark.parametrize("shape", [[-1], [1.0], ["2"], 3])
def test_bad_shape(shape: Any) -> None:
    msg = json_error({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": [1]}]})
    assert "input 'x'" in msg and "'shape'" in msg


def test_unknown_datatype() -> None:
    msg = json_error({"inputs": [{**X, "datatype": "FLOAT"}]})
    assert "unsupported datatype 'FLOAT'" in msg


def test_duplicate_input_name() -> None:
    assert "input 'x' appears twice" in json_error({"inputs": [X, X]})


def test_both_data_and_binary_data_size() -> None:
    body, length = binary_body(
        {"inputs": [{**X, "parameters": {"binary_data_size": 4}}]}, b"\0" * 4
    )
    assert "both 'data' and 'binary_data_size'" in decode_error(body, length)


def test_neither_data_nor_binary_data_size() -> None:
    msg = json_error({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]})
    assert "neither 'data' nor 'parameters.binary_data_size'" in msg


@pytest.mark.parametrize("size", [-4, "4", 1.5, True])
def test_bad_binary_data_size(size: Any) -> None:
    msg = json_error(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
    )
    assert "'binary_data_size' must be a non-negative integer" in msg


def test_binary_data_past_the_end_is_truncated() -> None:
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [4],
                    "parameters": {"binary_data_size": 16},
                }
            ]
        },
        b"\0" * 10,
    )
    msg = decode_error(body, length)
    assert "input 'x'" in msg and "16" in msg and "10 binary bytes left" in msg
    assert "truncated" in msg


def test_leftover_binary_bytes() -> None:
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        },
        b"\0" * 7,
    )
    msg = decode_error(body, length)
    assert "3 bytes of binary data follow the last input" in msg


def test_binary_size_disagreeing_with_shape() -> None:
    body, length = binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        },
        b"\0" * 4,
    )
    assert (
        "input byte size mismatch for input 'x' for model 'm'. Expected 8, got 4"
        in decode_error(body, length)
    )


@pytest.mark.parametrize("where", ["input", "output"])
def test_shared_memory_is_refused(where: str) -> None:
    shm = {"shared_memory_region": "r0", "shared_memory_byte_size": 4}
    doc: dict[str, Any] = {"inputs": [X]}
    if where == "input":
        doc["inputs"] = [{"name": "x", "datatype": "FP32", "shape": [1], "parameters": shm}]
    else:
        doc["outputs"] = [{"name": "y", "parameters": shm}]
    assert f"shared-memory {where}s are not enabled" in json_error(doc)


def test_bad_parameters_and_flags() -> None:
    assert "'parameters' must be an object" in json_error({"inputs": [{**X, "parameters": [1]}]})
    assert "'binary_data_output' must be true or false" in json_error(
        {"inputs": [X], "parameters": {"binary_data_output": "yes"}}
    )
    assert "output 'y': parameter 'binary_data' must be true or false" in json_error(
        {"inputs": [X], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]}
    )


def test_bad_outputs() -> None:
    assert "'outputs' must be a list" in json_error({"inputs": [X], "outputs": {"y": 1}})
    assert "outputs[0] must be an object with a 'name'" in json_error(
        {"inputs": [X], "outputs": [{"parameters": {}}]}
    )
    assert "'classification' must be a non-negative integer" in json_error(
        {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": -1}}]}
    )


@pytest.mark.parametrize("timeout", [-1, "10", 1.5, True])
def test_bad_timeout(timeout: Any) -> None:
    msg = json_error({"inputs": [X], "parameters": {"timeout": timeout}})
    assert "'timeout' must be a non-negative integer" in msg


def test_bad_id() -> None:
    assert "'id' must be a string" in json_error({"inputs": [X], "id": 5})


def test_bad_json_data_names_the_input() -> None:
    msg = json_error({"inputs": [{**X, "data": ["one"]}]})
    assert "input 'x': 'data' is not valid FP32" in msg


# ---- header length ------------------------------------------------------------------


def test_parse_header_length() -> None:
    assert parse_header_length(None, 10) is None
    assert parse_header_length("7", 10) == 7
    assert parse_header_length(" 10 ", 10) == 10


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "", "\u00b2"])
def test_parse_header_length_not_a_number(value: str) -> None:
    with pytest.raises(ApplianceError) as e:
        parse_header_length(value, 10)
    assert e.value.code is Code.INVALID_ARG
    assert f"{HEADER_LENGTH} must be a non-negative integer" in str(e.value)


def test_parse_header_length_past_the_body() -> None:
    with pytest.raises(ApplianceError) as e:
        parse_header_length("11", 10)
    assert e.value.code is Code.INVALID_ARG
    assert "is 11 but the body has only 10 bytes" in str(e.value)


# ---- encode -------------------------------------------------------------------------


def response(**outputs: np.ndarray) -> InferenceResponse:
    return InferenceResponse("simple", "1", dict(outputs), id="")


def test_encode_json_outputs() -> None:
    resp = response(
        a=np.array([[1.5, 2.0]], dtype=np.float32),
        b=np.array([1, 2], dtype=np.int64),
        h=np.array([0.5], dtype=np.float16),
        s=np.array([b"x", b"yz"], dtype=object),
    )
    body, length = encode_response(resp, OutputFormat())
    assert length is None
    doc = orjson.loads(body)
    assert doc["model_name"] == "simple" and doc["model_version"] == "1"
    assert "id" not in doc
    assert doc["outputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.0]},
        {"name": "b", "datatype": "INT64", "shape": [2], "data": [1, 2]},
        {"name": "h", "datatype": "FP16", "shape": [1], "data": [0.5]},
        {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["x", "yz"]},
    ]


def test_encode_binary_outputs() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([7, 8], dtype=np.int16)
    body, length = encode_response(response(a=a, b=b), OutputFormat(binary_default=True))
    assert length is not None
    doc, tail = split(body, length)
    sizes = [o["parameters"]["binary_data_size"] for o in doc["outputs"]]
    assert sizes == [a.nbytes, b.nbytes]
    assert all("data" not in o for o in doc["outputs"])
    assert tail[: a.nbytes] == a.tobytes()
    assert tail[a.nbytes :] == b.tobytes()


def test_encode_mixed_outputs() -> None:
    a = np.array([[1, 2], [3, 4]], dtype=np.int32).T  # non-contiguous
    fmt = OutputFormat(binary={"a": True, "j": False})
    body, length = encode_response(response(j=np.array([True]), a=a), fmt)
    doc, tail = split(body, length)
    j, out_a = doc["outputs"]
    assert j == {"name": "j", "datatype": "BOOL", "shape": [1], "data": [True]}
    assert out_a["shape"] == [2, 2] and out_a["parameters"]["binary_data_size"] == 16
    assert tail == struct.pack("<4i", 1, 3, 2, 4)


def test_encode_bytes_binary_output() -> None:
    s = np.array([b"ab", b"", "c\u00e9"], dtype=object)
    body, length = encode_response(response(s=s), OutputFormat(binary={"s": True}))
    doc, tail = split(body, length)
    expected = lp(b"ab", b"", "c\u00e9".encode())
    assert doc["outputs"][0]["datatype"] == "BYTES"
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == len(expected)
    assert tail == expected


def test_encode_empty_binary_output() -> None:
    e = np.zeros((0, 4), dtype=np.float32)
    body, length = encode_response(response(e=e), OutputFormat(binary_default=True))
    doc, tail = split(body, length)
    assert doc["outputs"][0]["shape"] == [0, 4]
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 0 and tail == b""


def test_encode_echoes_id() -> None:
    resp = InferenceResponse("m", "3", {"y": np.array([1.0], dtype=np.float32)}, id="req-42")
    body, _ = encode_response(resp, OutputFormat())
    assert orjson.loads(body)["id"] == "req-42"


def test_round_trip_through_the_wire() -> None:
    """What one side encodes in binary, the other side decodes to the same tensor."""
    y = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    body, length = encode_response(response(y=y), OutputFormat(binary_default=True))
    doc, _ = split(body, length)
    out = doc["outputs"][0]
    request_doc = {
        "inputs": [
            {
                "name": "y",
                "datatype": out["datatype"],
                "shape": out["shape"],
                "parameters": out["parameters"],
            }
        ]
    }
    header = orjson.dumps(request_doc)
    request, _ = decode_request(header + body[length:], len(header), "m", "")
    np.testing.assert_array_equal(request.inputs["y"], y)


def test_error_body() -> None:
    assert orjson.loads(error_body("model 'x' not found")) == {"error": "model 'x' not found"}
