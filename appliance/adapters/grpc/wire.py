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


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes | memoryview, size: int | None = None) -> bytes:
    """Key and length of a length-delimited field (the payload follows)."""
    n = len(payload) if size is None else size
    return _uvarint(number << 3 | _LEN) + _uvarint(n)


def _text(number: int, value: str) -> bytes:
    raw = value.encode()
    return _field(number, raw) + raw if raw else b""


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
    parts: list[bytes | memoryview] = [
        _text(1, response.model_name),
        _text(2, response.model_version),
        _text(3, response.id),
    ]
    raws: list[bytes | memoryview] = []
    for name, arr in response.outputs.items():
        shape = b"".join(_uvarint(int(d)) for d in arr.shape)
        tensor = _text(1, name) + _text(2, datatypes.from_numpy_dtype(arr.dtype))
        if shape:
            tensor += _field(3, shape) + shape
        parts.append(_field(5, tensor) + tensor)
        data = datatypes.to_raw(arr)
        ref = shm_outputs.get(name)
        if ref is not None:
            assert shm is not None  # the codec refused shared-memory outputs without one
            shm.write(ref.region, ref.offset, ref.byte_size, data, f"output '{name}'")
            data = b""
        raws.append(data)
    for data in raws:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        parts.append(_field(6, data, size))
        parts.append(data)
    if framed:
        total = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        parts.insert(0, struct.pack(">BI", 0, total))
    return b"".join(parts)
