"""KServe v2 HTTP/REST body codec, with Triton's binary tensor extension.

A request body is a JSON header optionally followed by raw tensor bytes; the
``Inference-Header-Content-Length`` header says where the JSON ends. A length of 0 is
Triton's raw binary request: the whole body is the model's only input, its name,
datatype and shape taken from the config when it is declared
(:func:`appliance.adapters.request_form.declare`), its outputs binary. Each input
with ``parameters.binary_data_size`` takes the next that many bytes, in order.
The body is read into the one request form (:mod:`appliance.adapters.request_form`,
which gRPC's codec fills too) and decoded from it; binary inputs become zero-copy
views of the body; binary outputs are written from views of the result arrays,
joined once into the response body.

Triton's system shared-memory extension: an input whose parameters name a
``shared_memory_region`` is a zero-copy view of that registered region; an
output that names one is written into it and its response entry carries no data
and no parameters, as Triton writes it (Triton's C++ client reads any ``parameters``
object of an output as binary data and fails without ``binary_data_size``).
"""

from __future__ import annotations

from typing import Any

import orjson

from appliance import datatypes
from appliance.adapters import request_form
from appliance.adapters.codec import json_tensors
from appliance.adapters.request_form import OutputFormat, RequestForm, TensorForm
from appliance.core.admission import Ticket
from appliance.core.shared_memory import SharedMemoryRef, SharedMemoryRegistry
from appliance.errors import internal, invalid
from appliance.request import (
    InferenceRequest,
    InferenceResponse,
    check_priority,
    check_sequence_id,
)

__all__ = [
    "HEADER_LENGTH",
    "OutputFormat",
    "decode_request",
    "encode_parts",
    "encode_response",
    "parse_request",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
# MQTT: an input whose data is a file on the device (see appliance.adapters.mqtt.protocol)
FILE_PARAMETER = "file_path"


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


def _shm_ref(params: dict[str, Any], where: str) -> SharedMemoryRef | None:
    """The shared-memory parameters of a tensor, type-checked; None when absent."""
    if "shared_memory_region" not in params:
        return None
    region = params["shared_memory_region"]
    if not isinstance(region, str) or not region:
        raise invalid(f"{where}: 'shared_memory_region' must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise invalid(f"{where}: shared-memory tensors need 'shared_memory_byte_size'")
    sizes = []
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        value = params.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
        sizes.append(value)
    return SharedMemoryRef(region, *sizes)


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
    body: bytes | bytearray,
    header_length: int | None,
    model: str,
    version: str,
    shared_memory: SharedMemoryRegistry | None = None,
    ticket: Ticket | None = None,
) -> tuple[InferenceRequest, OutputFormat]:
    """Body -> request: :func:`parse_request`, then the one declare and build of
    :mod:`appliance.adapters.request_form`."""
    form = parse_request(body, header_length, model, version)
    request_form.declare(form, ticket, shared_memory)
    return request_form.build(form, shared_memory), form.fmt


def parse_request(
    body: bytes | bytearray,
    header_length: int | None,
    model: str,
    version: str,
    files: bool = False,
) -> RequestForm:
    """Read a body into the request form, decoding no tensor: every malformed part
    is an INVALID_ARG naming what is wrong. ``files``: an input's
    ``parameters.file_path`` names a file on the device (MQTT), read before the build.

    Binary inputs are slices of the body; shared-memory inputs name a region window,
    checked and viewed by the build (a zero-copy view, valid after the region is
    unregistered); output windows are checked by ``request_form.declare``, before
    inference, and written by :func:`encode_response`.
    """
    view = memoryview(body)
    if header_length == 0:  # Triton's raw binary request: the body is the only input
        raw_input = TensorForm(request_form.RAW_INPUT, "", None, request_form.RAW, view)
        return RequestForm(model, version, [raw_input], OutputFormat(binary_default=True))
    json_part = view if header_length is None else view[:header_length]
    binary = view[len(json_part) :]
    # big bodies: tensor data parsed straight into arrays when pysimdjson is installed
    doc = json_tensors.loads(json_part)
    if doc is None:
        try:
            doc = orjson.loads(json_part)
        except orjson.JSONDecodeError as exc:
            raise invalid(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):  # empty: a model whose inputs are all optional
        raise invalid("the request must have an 'inputs' list")
    inputs: list[TensorForm] = []
    offset = 0
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise invalid(f"inputs[{i}] must be an object")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"inputs[{i}] needs a 'name' string")
        datatype = raw.get("datatype")
        if not isinstance(datatype, str):
            raise invalid(f"input '{name}' needs a 'datatype' string")
        params = raw.get("parameters", _NONE)
        if type(params) is not dict:
            params = _params(raw, f"input '{name}'")
        if params:
            kind, source, offset = _input_source(raw, name, params, binary, offset, files)
        elif "data" in raw:
            kind, source = request_form.JSON, raw["data"]
        else:
            raise invalid(
                f"input '{name}' has neither 'data' nor 'parameters.binary_data_size'"
            )
        inputs.append(TensorForm(name, datatype, raw.get("shape"), kind, source))
    if offset != len(binary):
        raise invalid(
            f"{len(binary) - offset} bytes of binary data follow the last input; "
            f"binary_data_size values and the body length disagree"
        )
    fmt = OutputFormat()
    outputs: list[str] = []
    classification: dict[str, int] = {}
    raw_outputs = doc.get("outputs", _EMPTY)
    if not isinstance(raw_outputs, list):
        raise invalid("'outputs' must be a list")
    for i, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise invalid(f"outputs[{i}] must be an object with a 'name' string")
        name = raw["name"]
        if name in fmt.binary:  # Triton's words
            raise invalid(f"output '{name}' already exists in request")
        params = raw.get("parameters", _NONE)
        if type(params) is dict and len(params) == 1 and params.get("binary_data") is True:
            fmt.binary[name] = True  # the common form
        else:
            _output(raw, name, fmt, classification)
        outputs.append(name)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("'id' must be a string")
    form = RequestForm(
        model, version, inputs, fmt, outputs=tuple(outputs), classification=classification,
        id=request_id,
    )  # fmt: skip
    if "parameters" in doc:
        _request_parameters(_params(doc, "request"), form)
    return form


_NONE: dict[str, Any] = {}  # (never written)
_EMPTY: list[Any] = []  # (never written)


def _input_source(
    raw: dict[str, Any],
    name: str,
    params: dict[str, Any],
    binary: memoryview,
    offset: int,
    files: bool,
) -> tuple[str, Any, int]:
    """Where an input with parameters has its data: (kind, source, the binary offset
    after it)."""
    where = f"input '{name}'"
    shm = _shm_ref(params, where)
    size = params.get("binary_data_size")
    if files and FILE_PARAMETER in params:
        if size is not None or "data" in raw or shm is not None:
            raise invalid(f"{where}: '{FILE_PARAMETER}' and another source of data")
        return request_form.FILE, params[FILE_PARAMETER], offset
    if shm is not None:
        if "data" in raw or size is not None:
            raise invalid(f"{where} has shared-memory parameters and also carries data")
        return request_form.SHM, shm, offset
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
        return request_form.RAW, binary[offset : offset + size], offset + size
    if "data" not in raw:
        raise invalid(f"{where} has neither 'data' nor 'parameters.binary_data_size'")
    return request_form.JSON, raw["data"], offset


def _output(
    raw: dict[str, Any], name: str, fmt: OutputFormat, classification: dict[str, int]
) -> None:
    """One requested output's parameters (binary, classification, shared memory)."""
    where = f"output '{name}'"
    params = _params(raw, where)
    fmt.binary[name] = _flag(params, "binary_data", where)
    count = params.get("classification", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise invalid(f"{where}: 'classification' must be a non-negative integer")
    if count:
        classification[name] = count
    shm = _shm_ref(params, where)
    if shm is not None:
        if count:
            raise invalid(f"{where}: a classification output cannot go to shared memory")
        fmt.shared_memory[name] = shm


def _request_parameters(params: dict[str, Any], form: RequestForm) -> None:
    """The request's own ``parameters`` into ``form``: the server's, type-checked,
    and the rest as the model's."""
    form.fmt.binary_default = _flag(params, "binary_data_output", "request")
    timeout = params.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0
    ):
        raise invalid("request parameter 'timeout' must be a non-negative integer (microseconds)")
    form.timeout_us = timeout or None
    form.sequence_id = check_sequence_id(params.get("sequence_id", 0))
    form.sequence_start = _flag(params, "sequence_start", "request")
    form.sequence_end = _flag(params, "sequence_end", "request")
    form.parameters = request_form.json_parameters(params)
    form.priority = check_priority(params.get("priority", 0))


def encode_response(
    response: InferenceResponse,
    fmt: OutputFormat,
    shared_memory: SharedMemoryRegistry | None = None,
) -> tuple[bytes, int | None]:
    """Response -> (body, JSON header length when binary outputs follow, else None):
    :func:`encode_parts` joined into one body."""
    parts, length = encode_parts(response, fmt, shared_memory)
    return b"".join(parts), length  # a lone part: join returns it, no copy


def encode_parts(
    response: InferenceResponse,
    fmt: OutputFormat,
    shared_memory: SharedMemoryRegistry | None = None,
) -> tuple[list[bytes | memoryview], int | None]:
    """Response -> (the body's parts: the JSON header, then each binary output's raw
    bytes, views of the arrays where they allow; the JSON header's length when binary
    outputs follow, else None). A transport writes the parts as they are.

    Outputs in ``fmt.shared_memory`` are written into their regions first; their
    entries carry name, datatype and shape only (Triton's form). An output larger
    than its window is an INVALID_ARG.
    """
    outputs = []
    chunks: list[bytes | memoryview] = []
    for name, arr in response.outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatypes.from_numpy_dtype(arr.dtype),
            "shape": list(arr.shape),
        }
        shm = fmt.shared_memory.get(name)
        if shm is not None:
            if shared_memory is None:
                raise internal(f"output '{name}' is bound for shared memory but no registry")
            raw = datatypes.to_raw(arr)
            shared_memory.write(shm.region, shm.offset, shm.byte_size, raw, f"output '{name}'")
        elif fmt.is_binary(name):
            raw = datatypes.to_raw(arr)
            entry["parameters"] = {
                "binary_data_size": len(raw) if isinstance(raw, bytes) else raw.nbytes
            }
            chunks.append(raw)
        else:
            entry["data"] = datatypes.to_json_data(arr, name)
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
        return [header], None
    return [header, *chunks], len(header)


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
