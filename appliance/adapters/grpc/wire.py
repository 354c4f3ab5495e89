"""``ModelInferRequest`` and ``ModelInferResponse`` straight from and to their wire bytes.

The unary ModelInfer RPC takes and returns bytes (no protobuf (de)serialiser in the
call layer's path, :mod:`appliance.adapters.grpc.calls`), so each message is handled
once:

- :func:`parse_request`: the request parsed once by protobuf's C parser; a message
  that is not a valid ``ModelInferRequest`` (a string field that is not UTF-8, a
  truncated message) is an INVALID_ARG, as Triton answers it (grpcio's server said
  UNKNOWN); :func:`parse_or_undecodable` does the same for every other RPC.
  :func:`raw_contents` gives the ``raw_input_contents`` entries as views of the wire
  bytes: reading them from the parsed message copies each (~1.4 ms per 6 MB frame).
- :func:`encode_response`: the response written as protobuf's canonical encoding
  (fields in number order), with each output's bytes joined once into the message
  (a protobuf message would take a copy of each, then copy again to serialise).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from appliance import datatypes
from appliance.core.shared_memory import SharedMemoryRef, SharedMemoryRegistry
from appliance.errors import ApplianceError, invalid
from appliance.request import InferenceResponse

_RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents
# ModelInferResponse: model_name 1, model_version 2, id 3, outputs 5, raw_output_contents 6;
# InferOutputTensor: name 1, datatype 2, shape 3 (packed int64)
_LEN = 2  # wire type of length-delimited fields


def parse_request(data: bytes) -> Any:
    """The ``ModelInferRequest`` in ``data``; INVALID_ARG when it is not one."""
    try:
        return service_pb2.ModelInferRequest.FromString(data)
    except DecodeError as exc:
        raise _undecodable("inference.ModelInferRequest", exc) from None


class Undecodable:
    """A request that protobuf could not parse, handed to its RPC to answer."""

    __slots__ = ("error",)

    def __init__(self, error: ApplianceError) -> None:
        self.error = error


def parse_or_undecodable(message: Any) -> Callable[[bytes], Any]:
    """A request deserialiser for ``message`` that never raises: grpcio would end the
    call with UNKNOWN; the RPC answers an :class:`Undecodable` with INVALID_ARGUMENT."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Undecodable(_undecodable(message.DESCRIPTOR.full_name, exc))

    return parse


def _undecodable(what: str, exc: Exception) -> ApplianceError:
    return invalid(
        f"the request is not a valid {what} ({exc}): every string field (model_name, "
        "model_version, id, names, datatypes) must be UTF-8"
    )


def _varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7


def raw_contents(data: bytes) -> list[memoryview]:
    """The ``raw_input_contents`` entries of a request that :func:`parse_request`
    accepted, as zero-copy views of ``data`` (only the top-level fields are walked)."""
    view = memoryview(data)
    out: list[memoryview] = []
    i, end = 0, len(data)
    while i < end:
        key, i = _varint(data, i)
        wire = key & 7
        if wire == _LEN:
            length, i = _varint(data, i)
            if key >> 3 == _RAW_INPUT_CONTENTS:
                out.append(view[i : i + length])
            i += length
        elif wire == 0:
            _, i = _varint(data, i)
        else:  # fixed64 (1) or fixed32 (5); groups do not occur in proto3
            i += 8 if wire == 1 else 4
    return out


# one-byte varints, the common case of every key and small length
_SMALL = [bytes((n,)) for n in range(0x80)]


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes | memoryview) -> bytes:
    """Key and length of a length-delimited field (the payload follows; a view is one
    of bytes, so its len() is its size)."""
    return _uvarint(number << 3 | _LEN) + _uvarint(len(payload))


def _text(number: int, value: str) -> bytes:
    raw = value.encode()
    return _field(number, raw) + raw if raw else b""


# the fixed fields of what a model answers, encoded once: (model name, version) -> the
# response's first two fields; (output name, dtype) -> the output tensor's name and
# datatype. Their keys are the loaded models' own names (bounded: cleared when full)
_models: dict[tuple[str, str], bytes] = {}
_outputs: dict[tuple[str, Any], bytes] = {}
_KEPT_MAX = 4096


def _keep(kept: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    if len(kept) >= _KEPT_MAX:
        kept.clear()
    kept[key] = encoded
    return encoded


def _shape(shape: tuple[int, ...]) -> bytes:
    """An output tensor's shape field (packed int64), empty for a scalar."""
    if not shape:
        return b""
    packed = bytes(shape) if max(shape) < 0x80 else b"".join(_uvarint(int(d)) for d in shape)
    return _field(3, packed) + packed


def encode_response(
    response: InferenceResponse,
    shm_outputs: dict[str, SharedMemoryRef],
    shm: SharedMemoryRegistry | None,
    framed: bool = False,
) -> bytes:
    """The ``ModelInferResponse`` bytes for ``response``, as protobuf would write the
    message :func:`appliance.adapters.grpc.codec.encode_response` builds: one
    ``raw_output_contents`` entry per output, in output order (clients index them by
    the output's position), empty for an output written to its shared-memory region.
    ``framed``: with gRPC's 5-byte message prefix in front, in the same join."""
    name, version = response.model_name, response.model_version
    head = _models.get((name, version))
    if head is None:
        head = _keep(_models, (name, version), _text(1, name) + _text(2, version))
    parts: list[bytes | memoryview] = [head]
    if response.id:
        parts.append(_text(3, response.id))
    raws: list[bytes | memoryview] = []
    for output, arr in response.outputs.items():
        dtype = arr.dtype
        head = _outputs.get((output, dtype))
        if head is None:
            named = _text(1, output) + _text(2, datatypes.from_numpy_dtype(dtype))
            head = _keep(_outputs, (output, dtype), named)
        tensor = head + _shape(arr.shape)
        parts.append(_field(5, tensor) + tensor)
        data = datatypes.to_raw(arr)  # bytes, or a view of bytes ("B"): len() is its size
        if shm_outputs:
            ref = shm_outputs.get(output)
            if ref is not None:
                assert shm is not None  # the codec refused shared-memory outputs without one
                shm.write(ref.region, ref.offset, ref.byte_size, data, f"output '{output}'")
                data = b""
        raws.append(data)
    for data in raws:
        parts.append(_field(6, data))
        parts.append(data)
    if framed:
        parts.insert(0, struct.pack(">BI", 0, sum(map(len, parts))))
    return b"".join(parts)
