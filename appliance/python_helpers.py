"""The parts of :mod:`appliance.python_model` (Triton's ``pb_utils``) that need no
tensor or request class: the flags, the errors, the response sender and the checks of
a BLS request's parameters, the logger, tensor and config look-ups, type names and
byte tensors."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from appliance import datatypes

_log = logging.getLogger("appliance.python_model")


TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2


class TritonError(Exception):
    """An error a model returns (``InferenceResponse(error=...)``) or raises.

    ``INVALID_ARG`` becomes a client error (HTTP 400); every other code an
    internal error counted as a backend failure.
    """

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by Triton's utilities on misuse; kept for models that catch it."""


def json_text(parameters: dict[str, Any] | str | None) -> str:
    return parameters if isinstance(parameters, str) else json.dumps(parameters or {})


def bls_parameters(parameters: dict[str, Any] | str | None) -> str:
    """A BLS request's ``parameters``: a dict of str keys and bool/int/str values, as
    Triton's stub checks them (its texts), as JSON."""
    if parameters is None or isinstance(parameters, str):
        return json_text(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, found type {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    return json.dumps(parameters)


# (response or None, final) -> delivered to the caller of a decoupled model
Deliver = Callable[[Any, bool], None]


class InferenceResponseSender:
    """A model's way to answer through ``request.get_response_sender()``:
    ``send(response, flags)`` any number of times from any thread (a decoupled model),
    the last one with ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL`` (with or without a
    response). A regular model may send one response with the final flag instead of
    returning it. The misuses raise Triton's texts."""

    def __init__(
        self,
        deliver: Deliver,
        cancelled: Callable[[], bool] | None = None,
        decoupled: bool = True,
    ) -> None:
        self._deliver = deliver
        self._closed = False
        self._sent = 0
        self._cancelled = cancelled
        self._decoupled = decoupled

    def send(self, response: Any = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if not self._decoupled:
            if response is not None and self._sent:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than "
                    "one response."
                )
            if response is None and not self._sent:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send complete "
                    "final before sending a response."
                )
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        self._closed = final
        self._sent += 1
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """True once the caller went away: the model may stop."""
        return self._cancelled is not None and self._cancelled()

    def close(self) -> None:
        """No more responses may be sent (Triton's ``close()``)."""
        self._closed = True


class Logger:
    """``pb_utils.Logger.log_info(...)``: lines in the server's log."""

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        _log.log(level, "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug("%s", message)


def get_input_tensor_by_name(request: Any, name: str) -> Any:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: Any, name: str) -> Any:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(config_type: str) -> Any:
    """``TYPE_FP32`` -> ``numpy.float32`` (``TYPE_STRING`` -> ``numpy.object_``)."""
    return datatypes.to_numpy_dtype(datatypes.from_config_type(config_type)).type


def triton_to_numpy_type(datatype: str) -> Any:
    """``FP32`` -> ``numpy.float32`` (KServe names, as Triton's helper takes them)."""
    return datatypes.to_numpy_dtype(datatype).type


def numpy_to_triton_type(dtype: Any) -> str:
    return datatypes.from_numpy_dtype(np.dtype(dtype))


def serialize_byte_tensor(array: np.ndarray) -> np.ndarray:
    """BYTES elements -> Triton's wire form (4-byte little-endian length + bytes)."""
    raw = datatypes.to_raw(np.asarray(array, dtype=object))
    return np.frombuffer(bytes(raw), dtype=np.uint8)


def deserialize_bytes_tensor(encoded: bytes) -> np.ndarray:
    raw = bytes(encoded)
    out, offset = [], 0
    while offset < len(raw):
        size = int.from_bytes(raw[offset : offset + 4], "little")
        out.append(raw[offset + 4 : offset + 4 + size])
        offset += 4 + size
    arr = np.empty(len(out), dtype=object)
    arr[:] = out
    return arr


def model_config(args: dict[str, str]) -> dict[str, Any]:
    """The model config ``initialize`` received, parsed (``json.loads(args["model_config"])``)."""
    parsed: dict[str, Any] = json.loads(args["model_config"])
    return parsed
