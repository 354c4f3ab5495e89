"""KServe datatypes <-> numpy, Triton config names, raw bytes and JSON data."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from appliance import datatypes
from appliance.errors import ApplianceError, Code

NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
FIXED = [d for d in NUMPY if d != "BYTES"]


def invalid_arg(excinfo: pytest.ExceptionInfo[ApplianceError]) -> str:
    assert excinfo.value.code is Code.INVALID_ARG
    return str(excinfo.value)


def lp(*items: bytes) -> bytes:
    """Triton's length-prefixed BYTES encoding, written out by hand."""
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# ---- numpy and config names ---------------------------------------------------------


def test_every_kserve_datatype_is_supported() -> None:
    assert set(datatypes.DATATYPES) == set(NUMPY)


@pytest.mark.parametrize("datatype", list(NUMPY))
def test_datatype_to_numpy_and_back(datatype: str) -> None:
    dtype = datatypes.to_numpy_dtype(datatype)
    assert dtype == np.dtype(NUMPY[datatype])
    assert datatypes.from_numpy_dtype(dtype) == datatype


@pytest.mark.parametrize("dtype", ["<U5", "S3", object])
def test_string_dtypes_are_bytes(dtype: str) -> None:
    assert datatypes.from_numpy_dtype(np.dtype(dtype)) == "BYTES"


def test_big_endian_dtype_has_its_kserve_name() -> None:
    assert datatypes.from_numpy_dtype(np.dtype(">i4")) == "INT32"
    assert datatypes.from_numpy_dtype(np.dtype(">f2")) == "FP16"


def test_unknown_datatype_is_invalid_arg() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.to_numpy_dtype("FP8")
    msg = invalid_arg(e)
    assert "'FP8'" in msg and "FP32" in msg


def test_numpy_dtype_without_kserve_name() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_numpy_dtype(np.dtype(np.complex64))
    assert "complex64" in invalid_arg(e)


@pytest.mark.parametrize("datatype", list(NUMPY))
def test_config_type_round_trip(datatype: str) -> None:
    config_type = datatypes.to_config_type(datatype)
    assert config_type.startswith("TYPE_")
    assert datatypes.from_config_type(config_type) == datatype
    assert datatypes.from_config_type(datatype) == datatype  # KServe name accepted too


def test_config_type_names() -> None:
    assert datatypes.to_config_type("FP32") == "TYPE_FP32"
    assert datatypes.to_config_type("BYTES") == "TYPE_STRING"
    assert datatypes.from_config_type("TYPE_STRING") == "BYTES"
    assert datatypes.from_config_type("type_int64") == "INT64"


def test_unknown_config_type() -> None:
    with pytest.raises(ValueError):
        datatypes.from_config_type("TYPE_COMPLEX")


def test_byte_size() -> None:
    assert datatypes.byte_size("FP32", [2, 3]) == 24
    assert datatypes.byte_size("FP16", [4]) == 8
    assert datatypes.byte_size("BOOL", [0, 5]) == 0
    assert datatypes.byte_size("BYTES", [2]) is None


def test_check_shape() -> None:
    assert datatypes.check_shape([1, 0, 3], "input 'x'") == [1, 0, 3]
    for bad in ([-1], [1.5], "3", [True], None):
        with pytest.raises(ApplianceError) as e:
            datatypes.check_shape(bad, "input 'x'")
        assert invalid_arg(e).startswith("input 'x': 'shape' must be")


# ---- raw bytes ----------------------------------------------------------------------


@pytest.mark.parametrize("datatype", FIXED)
def test_from_raw_is_zero_copy(datatype: str) -> None:
    expected = np.arange(6).astype(NUMPY[datatype]).reshape(2, 3)
    body = b"header" + expected.tobytes() + b"tail"
    view = memoryview(body)[6 : 6 + expected.nbytes]
    arr = datatypes.from_raw(view, datatype, [2, 3], "x")
    assert arr.shape == (2, 3) and arr.dtype == expected.dtype
    np.testing.assert_array_equal(arr, expected)
    assert np.shares_memory(arr, np.frombuffer(body, dtype=np.uint8))


def test_from_raw_wrong_byte_count_names_the_input() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_raw(b"\0" * 10, "FP32", [2, 2], "pixels")
    msg = invalid_arg(e)
    assert "input byte size mismatch for input 'pixels' for model ''. Expected 16, got 10" in msg


def test_from_raw_bytes() -> None:
    arr = datatypes.from_raw(lp(b"ab", b""), "BYTES", [2], "s")
    assert arr.dtype == object and arr.tolist() == [b"ab", b""]


def test_to_raw_is_little_endian_row_major() -> None:
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert bytes(datatypes.to_raw(arr)) == struct.pack("<6i", *range(6))


def test_to_raw_non_contiguous() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # columns 0 and 2
    assert not arr.flags.c_contiguous
    raw = bytes(datatypes.to_raw(arr))
    assert raw == struct.pack("<6f", 0, 2, 4, 6, 8, 10)


def test_to_raw_transposed() -> None:
    arr = np.arange(6, dtype=np.int16).reshape(2, 3).T
    assert bytes(datatypes.to_raw(arr)) == struct.pack("<6h", 0, 3, 1, 4, 2, 5)


def test_to_raw_big_endian() -> None:
    arr = np.array([1, 256, -2], dtype=">i4")
    assert bytes(datatypes.to_raw(arr)) == struct.pack("<3i", 1, 256, -2)
    floats = np.array([1.5, -2.25], dtype=">f8")
    assert bytes(datatypes.to_raw(floats)) == struct.pack("<2d", 1.5, -2.25)


def test_to_raw_empty_array() -> None:
    assert bytes(datatypes.to_raw(np.zeros((0, 3), dtype=np.float32))) == b""


def test_to_raw_bool_and_fp16() -> None:
    assert bytes(datatypes.to_raw(np.array([True, False, True]))) == b"\x01\x00\x01"
    assert bytes(datatypes.to_raw(np.array([1.0], dtype=np.float16))) == struct.pack("<e", 1.0)


@pytest.mark.parametrize("datatype", FIXED)
def test_raw_round_trip(datatype: str) -> None:
    arr = (np.arange(4) % 2 if datatype == "BOOL" else np.arange(4)).astype(NUMPY[datatype])
    back = datatypes.from_raw(bytes(datatypes.to_raw(arr)), datatype, [4], "x")
    np.testing.assert_array_equal(back, arr)


# ---- BYTES encoding -----------------------------------------------------------------


def test_bytes_round_trip_with_empty_and_non_utf8() -> None:
    items = [b"hello", b"", b"\xff\xfe\x00binary", "caf\u00e9".encode()]
    arr = np.array(items, dtype=object).reshape(2, 2)
    raw = datatypes.serialize_bytes(arr)
    assert raw == lp(*items)
    back = datatypes.deserialize_bytes(raw, [2, 2], "s")
    assert back.shape == (2, 2) and back.dtype == object
    assert back.ravel().tolist() == items


def test_serialize_str_and_numpy_strings() -> None:
    assert datatypes.serialize_bytes(np.array(["ab", "\u00e9"])) == lp(b"ab", "\u00e9".encode())
    assert datatypes.serialize_bytes(np.array([b"xy"], dtype="S2")) == lp(b"xy")
    assert datatypes.to_raw(np.array(["q"], dtype=object)) == lp(b"q")


def test_bytes_truncated_length_prefix() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.deserialize_bytes(lp(b"abc") + b"\x01\x00", [2], "words", "m")
    msg = invalid_arg(e)
    # Triton's text (L0_input_validation), then what is left
    assert msg == (
        "expected 2 string elements for inference input 'words' for model 'm', got 1 "
        "(2 bytes left)"
    )


def test_bytes_element_past_the_end() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.deserialize_bytes(struct.pack("<I", 10) + b"abc", [1], "words")
    msg = invalid_arg(e)
    assert "'words'" in msg and "claims 10 bytes but only 3 remain" in msg


def test_bytes_trailing_garbage() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.deserialize_bytes(lp(b"a") + b"zz", [1], "words", "m")
    msg = invalid_arg(e)
    assert msg == (
        "unexpected number of string elements 2 for inference input 'words' for model 'm', "
        "expecting 1 (2 bytes follow the last element)"
    )


def test_bytes_empty_tensor() -> None:
    assert datatypes.deserialize_bytes(b"", [0, 3], "s").shape == (0, 3)


# ---- JSON data ----------------------------------------------------------------------


def test_from_json_nested_and_flat_agree() -> None:
    nested = datatypes.from_json_data([[1, 2, 3], [4, 5, 6]], "INT32", [2, 3], "x")
    flat = datatypes.from_json_data([1, 2, 3, 4, 5, 6], "INT32", [2, 3], "x")
    assert nested.dtype == np.int32 and nested.shape == (2, 3)
    np.testing.assert_array_equal(nested, flat)
    assert flat[1, 0] == 4


def test_from_json_floats_accept_integers() -> None:
    arr = datatypes.from_json_data([1, 2.5], "FP32", [2], "x")
    assert arr.dtype == np.float32 and arr.tolist() == [1.0, 2.5]


def test_from_json_wrong_element_count() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data([1, 2, 3], "FP32", [2, 2], "x")
    msg = invalid_arg(e)
    assert "'x'" in msg and "3 elements" in msg and "needs 4" in msg


@pytest.mark.parametrize("data", [["a", "b"], ["1", "2"], [1.5, 2], [None, 1], [True, False]])
def test_from_json_wrong_element_type_for_int32(data: list[object]) -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data(data, "INT32", [2], "ids")
    msg = invalid_arg(e)
    assert "'ids'" in msg and "not valid INT32" in msg


@pytest.mark.parametrize("data", [["1.5"], [None], [True]])
def test_from_json_wrong_element_type_for_fp32(data: list[object]) -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data(data, "FP32", [1], "x")
    assert "not valid FP32" in invalid_arg(e)


@pytest.mark.parametrize(
    ("value", "datatype"), [(300, "UINT8"), (-1, "UINT8"), (2**31, "INT32"), (2**63, "INT64")]
)
def test_from_json_overflow(value: int, datatype: str) -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data([value], datatype, [1], "x")
    assert f"not valid {datatype}" in invalid_arg(e)


def test_from_json_ragged_list() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data([[1, 2], [3]], "INT32", [3], "x")
    assert "not valid INT32" in invalid_arg(e)


def test_from_json_not_a_list() -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data({"a": 1}, "INT32", [1], "x")
    assert "'data' must be a list, got dict" in invalid_arg(e)


def test_from_json_bool() -> None:
    arr = datatypes.from_json_data([[True, False]], "BOOL", [1, 2], "flags")
    assert arr.dtype == np.bool_ and arr.tolist() == [[True, False]]


@pytest.mark.parametrize("data", [["false", "true"], [0, 1]])
def test_from_json_bool_rejects_non_booleans(data: list[object]) -> None:
    with pytest.raises(ApplianceError) as e:
        datatypes.from_json_data(data, "BOOL", [2], "flags")
    assert "not valid BOOL" in invalid_arg(e)


def test_from_json_bytes() -> None:
    arr = datatypes.from_json_data([["a", "\u00e9"]], "BYTES", [1, 2], "s")
    assert arr.dtype == object and arr.tolist() == [[b"a", "\u00e9".encode()]]


def test_from_json_empty_tensor() -> None:
    assert datatypes.from_json_data([], "INT64", [0], "x").shape == (0,)


def test_to_json_data_fp16_is_serializable() -> None:
    data = datatypes.to_json_data(np.array([[0.5, 1.5]], dtype=np.float16))
    assert orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)) == [0.5, 1.5]


def test_to_json_data_is_flat() -> None:
    data = datatypes.to_json_data(np.arange(6, dtype=np.int64).reshape(2, 3).T)
    assert orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)) == [0, 3, 1, 4, 2, 5]


def test_to_json_data_big_endian() -> None:
    data = datatypes.to_json_data(np.array([1, 2], dtype=">i4"))
    assert orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)) == [1, 2]


def test_to_json_data_bool() -> None:
    data = datatypes.to_json_data(np.array([True, False]))
    assert orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)) == [True, False]


def test_to_json_data_bytes_as_strings() -> None:
    data = datatypes.to_json_data(np.array([b"ab", "é".encode(), "s"], dtype=object))
    assert data == ["ab", "é", "s"]
    # bytes that are not UTF-8 have no JSON form: refused, never replaced in silence
    with pytest.raises(ApplianceError) as e:
        datatypes.to_json_data(np.array([b"ab", b"\xff"], dtype=object), "y")
    assert invalid_arg(e).startswith("output 'y': a BYTES element is not UTF-8")
