"""The simdjson path for big JSON requests gives exactly what the orjson path gives.

Each case is decoded twice by :func:`appliance.adapters.codec.kserve.decode_request`: with
pysimdjson (bodies above ``MIN_BYTES``) and with it switched off; the arrays, or
the error messages, must be identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from appliance.adapters.codec import json_tensors, kserve
from appliance.errors import ApplianceError

pytestmark = pytest.mark.skipif(not json_tensors.AVAILABLE, reason="pysimdjson not installed")
PAD = [0] * (json_tensors.MIN_BYTES // 2)  # makes every body big enough for the fast path


def _decode(body: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(json_tensors, "simdjson", None)
        try:
            request, fmt = kserve.decode_request(body, None, "m", "")
        except ApplianceError as exc:
            return ("error", exc.code, exc.message)
    return request, fmt


def _same(body: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    fast, slow = _decode(body, True, monkeypatch), _decode(body, False, monkeypatch)
    if slow[0] == "error":
        assert fast == slow
        return slow
    assert fast[0].inputs.keys() == slow[0].inputs.keys()
    for name, arr in slow[0].inputs.items():
        assert fast[0].inputs[name].dtype == arr.dtype
        assert fast[0].inputs[name].shape == arr.shape
        np.testing.assert_array_equal(fast[0].inputs[name], arr)
    assert (fast[0].id, fast[0].outputs, fast[0].timeout_us) == (
        slow[0].id,
        slow[0].outputs,
        slow[0].timeout_us,
    )
    assert fast[1].binary == slow[1].binary and fast[1].binary_default == slow[1].binary_default
    return fast


def _body(data: list[Any], datatype: str, shape: list[int] | None = None, **extra: Any) -> bytes:
    doc = {
        "id": "r1",
        "inputs": [
            {"name": "x", "datatype": datatype, "shape": shape or [len(data)], "data": data}
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        "parameters": {"binary_data_output": False, "timeout": 5000},
        **extra,
    }
    return orjson.dumps(doc)


def test_a_frame_of_floats(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).random((1, 3, 64, 64)).astype(np.float32)
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 3, 64, 64], "data": x.ravel()}
    body = orjson.dumps({"inputs": [tensor]}, option=orjson.OPT_SERIALIZE_NUMPY)
    assert len(body) >= json_tensors.MIN_BYTES
    assert isinstance(json_tensors.loads(body)["inputs"][0]["data"], json_tensors.LazyData)
    request, _ = _same(body, monkeypatch)
    np.testing.assert_array_equal(request.inputs["x"], x)


@pytest.mark.parametrize(
    ("head", "datatype"),
    [
        ([1.5, -2.25e-3, 3], "FP32"),
        ([0.1, 1e-310, 1.7976931348623157e308], "FP64"),
        ([0.5, 65504.0], "FP16"),
        ([-128, 127], "INT8"),
        ([0, 255], "UINT8"),
        ([2**63 - 1, -(2**63)], "INT64"),
        ([2**64 - 1, 0], "UINT64"),
        ([True, False], "BOOL"),
        ([1.0, True], "FP32"),  # what the orjson path accepts, the fast path accepts
    ],
)
def test_values_match_the_orjson_path(head, datatype, monkeypatch) -> None:
    pad = [False] * len(PAD) if datatype == "BOOL" else PAD
    _same(_body(head + pad, datatype), monkeypatch)


@pytest.mark.parametrize(
    ("head", "datatype", "message"),
    [
        ([300], "INT8", "out of bounds for int8"),
        ([-1], "UINT8", "out of bounds for uint8"),
        ([1.5], "INT32", "expected integer values"),
        ([1, "7"], "FP32", "expected numeric values"),
        ([1, None], "FP32", "expected numeric values"),
        ([2**63], "INT64", "too large"),
        ([1], "BOOL", "expected true or false"),
    ],
)
def test_errors_match_the_orjson_path(head, datatype, message, monkeypatch) -> None:
    result = _same(_body(head + PAD, datatype), monkeypatch)
    assert result[0] == "error" and message in result[2]


def test_shapes_nesting_and_malformed_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    n = len(PAD)
    _same(_body(PAD, "INT32", [n + 1]), monkeypatch)  # wrong element count
    nested = [[1, 2]] * (n // 2)
    _same(_body(nested, "INT32", [n // 2, 2]), monkeypatch)
    ragged = [[1, 2], [3], *nested]
    assert _same(_body(ragged, "INT32", [n // 2 + 2, 2]), monkeypatch)[0] == "error"
    big = b" " * json_tensors.MIN_BYTES
    for bad in (b'{"inputs": [', b"[1, 2]", b'{"inputs": [{"name": "x"}], "v": 1e999}'):
        assert _same(bad + big, monkeypatch)[0] == "error"


def test_fast_path_survives_errors_kept_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # a refused request's traceback can keep its document alive; later requests on the
    # same thread must still take the fast path (simdjson refuses to reuse a busy parser)
    bad = _body(PAD, "FP32", [3])
    kept = []
    for _ in range(3):
        with pytest.raises(ApplianceError) as info:
            kserve.decode_request(bad, None, "m", "")
        kept.append(info.value)
    doc = json_tensors.loads(_body(PAD, "FP32"))
    assert doc is not None and isinstance(doc["inputs"][0]["data"], json_tensors.LazyData)
    _same(_body(PAD, "FP32"), monkeypatch)
