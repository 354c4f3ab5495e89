"""KServe v2 HTTP/REST body codec, with Triton's binary tensor extension.

A request body is a JSON header optionally followed by raw tensor bytes; the
``Inference-Header-Content-Length`` header says where the JSON ends. Each input
with ``parameters.binary_data_size`` takes the next that many bytes, in order.
Binary inputs become zero-copy views of the body; binary outputs are written
from views of the result arrays, joined once into the response body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from appliance import datatypes
from appliance.errors import invalid
from appliance.request import InferenceRequest, InferenceResponse

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(slots=True)
class OutputFormat:
    """How the caller wants outputs encoded: per-output binary flags and the default."""

    binary: dict[str, bool] = field(default_factory=dict)
    binary_default: bool = False

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise invalid(f"{where}: 'parameters' must be an object")
    return params


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise invalid(f"{where}: parameter '{key}' must be true or false, got {value!r}")
    return value


def parse_header_length(value: str | None, body_length: int) -> int | None:
    if value is None:
        return None
    # isascii: str.isdigit also accepts digits such as '²' that int() rejects
    if not (value.strip().isascii() and value.strip().isdigit()):
        raise invalid(f"{HEADER_LENGTH} must be a non-negative integer, got {value!r}")
    length = int(value)
    if length > body_length:
        raise invalid(f"{HEADER_LENGTH} is {length} but the body has only {body_length} bytes")
    return length


def decode_request(
    body: bytes, header_length: int | None, model: str, version: str
) -> tuple[InferenceRequest, OutputFormat]:
    """Body -> request. Every malformed part is an INVALID_ARG naming what is wrong."""
    view = memoryview(body)
    json_part = view if header_length is None else view[:header_length]
    binary = view[len(json_part) :]
    try:
        doc = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise invalid("the request must have a non-empty 'inputs' list")
    inputs = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise invalid(f"inputs[{i}] must be an object")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"inputs[{i}] needs a 'name' string")
        where = f"input '{name}'"
        if name in inputs:
            raise invalid(f"{where} appears twice")
        datatype = raw.get("datatype")
        if not isinstance(datatype, str):
            raise invalid(f"{where} needs a 'datatype' string")
        datatypes.to_numpy_dtype(datatype)  # unknown datatype -> INVALID_ARG
        shape = datatypes.check_shape(raw.get("shape"), where)
        params = _params(raw, where)
        if "shared_memory_region" in params:
            raise invalid(f"{where}: shared-memory inputs are not enabled on this server")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"{where}: 'binary_data_size' must be a non-negative integer")
            if "data" in raw:
                raise invalid(f"{where} has both 'data' and 'binary_data_size'")
            if offset + size > len(binary):
                raise invalid(
                    f"{where}: binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - offset} binary bytes left): the body is truncated"
                )
            inputs[name] = datatypes.from_raw(binary[offset : offset + size], datatype, shape, name)
            offset += size
        elif "data" in raw:
            inputs[name] = datatypes.from_json_data(raw["data"], datatype, shape, name)
        else:
            raise invalid(f"{where} has neither 'data' nor 'parameters.binary_data_size'")
    if offset != len(binary):
        raise invalid(
            f"{len(binary) - offset} bytes of binary data follow the last input; "
            f"binary_data_size values and the body length disagree"
        )
    req_params = _params(doc, "request")
    fmt = OutputFormat(binary_default=_flag(req_params, "binary_data_output", "request"))
    outputs: list[str] = []
    classification: dict[str, int] = {}
    raw_outputs = doc.get("outputs", [])
    if not isinstance(raw_outputs, list):
        raise invalid("'outputs' must be a list")
    for i, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise invalid(f"outputs[{i}] must be an object with a 'name' string")
        name = raw["name"]
        params = _params(raw, f"output '{name}'")
        if "shared_memory_region" in params:
            raise invalid(f"output '{name}': shared-memory outputs are not enabled on this server")
        fmt.binary[name] = _flag(params, "binary_data", f"output '{name}'")
        count = params.get("classification", 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise invalid(f"output '{name}': 'classification' must be a non-negative integer")
        if count:
            classification[name] = count
        outputs.append(name)
    timeout = req_params.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0
    ):
        raise invalid("request parameter 'timeout' must be a non-negative integer (microseconds)")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("'id' must be a string")
    request = InferenceRequest(
        model_name=model,
        inputs=inputs,
        model_version=version,
        outputs=tuple(outputs),
        id=request_id,
        timeout_us=timeout or None,
        classification=classification,
    )
    return request, fmt


def encode_response(response: InferenceResponse, fmt: OutputFormat) -> tuple[bytes, int | None]:
    """Response -> (body, JSON header length when binary outputs follow, else None)."""
    outputs = []
    chunks: list[bytes | memoryview] = []
    for name, arr in response.outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatypes.from_numpy_dtype(arr.dtype),
            "shape": list(arr.shape),
        }
        if fmt.is_binary(name):
            raw = datatypes.to_raw(arr)
            entry["parameters"] = {
                "binary_data_size": len(raw) if isinstance(raw, bytes) else raw.nbytes
            }
            chunks.append(raw)
        else:
            entry["data"] = datatypes.to_json_data(arr)
        outputs.append(entry)
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
    }
    if response.id:
        doc["id"] = response.id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
