"""What a Python model's ``model.py`` imports: Triton's ``triton_python_backend_utils``.

A Triton repository's ``model.py`` loads unchanged: the Python backend makes this
module importable as ``triton_python_backend_utils`` (``import
triton_python_backend_utils as pb_utils``); ``from appliance import python_model as
pb_utils`` is the same module under its own name. The API follows Triton's:
``Tensor``, ``InferenceRequest`` / ``InferenceResponse`` (with BLS ``exec()`` and
``async_exec()``, see :mod:`appliance.bls`), the response sender of decoupled models,
``TritonError``, ``Logger`` and the ``get_*_by_name`` / type helpers. Tensors are
numpy arrays (``as_numpy``); DLPack works for CPU tensors; there is no GPU tensor.

One difference from Triton: the appliance's batcher gathers the requests it
batches into one tensor per input, so ``execute`` receives one request whose
tensors hold every row of the batch, and returns one response with as many rows.
A model that loops over ``requests`` and handles whole tensors works unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from appliance import bls, datatypes
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceRequest as _Request
from appliance.request import InferenceResponse as _Response

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
_log = logging.getLogger("appliance.python_model")


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


class Tensor:
    """A named numpy array."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """From any object with ``__dlpack__`` (a CPU torch tensor, ...) or a bare
        DLPack capsule of CPU memory."""
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        return Tensor(name, np.from_dlpack(source))


class _Capsule:
    """A bare DLPack capsule dressed as the protocol numpy reads (CPU memory only)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class InferenceResponse:
    """The outputs of one request, or the error that replaced them."""

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = output_tensors or []
        self._error = error
        self._parameters = _json_text(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


def _json_text(parameters: dict[str, Any] | str | None) -> str:
    return parameters if isinstance(parameters, str) else json.dumps(parameters or {})


# (response or None, final) -> delivered to the caller of a decoupled model
Deliver = Callable[[InferenceResponse | None, bool], None]


class InferenceResponseSender:
    """A decoupled model's way to answer: ``send(response, flags)`` any number of
    times, from any thread, the last one with ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``
    (with or without a response). Sending after the final response is an error."""

    def __init__(self, deliver: Deliver, cancelled: Callable[[], bool] | None = None) -> None:
        self._deliver = deliver
        self._closed = False
        self._cancelled = cancelled

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonError("the final response was already sent for this request")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonError("send() needs a response unless flags mark the final one")
        self._closed = final
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """True once the caller went away (a closed stream): the model may stop."""
        return self._cancelled is not None and self._cancelled()


def _error_of(exc: ApplianceError) -> TritonError:
    code = {
        Code.INVALID_ARG: TritonError.INVALID_ARG,
        Code.NOT_FOUND: TritonError.NOT_FOUND,
        Code.UNAVAILABLE: TritonError.UNAVAILABLE,
    }.get(exc.code, TritonError.INTERNAL)
    return TritonError(exc.message, code)


def _response_of(result: _Response | ApplianceError) -> InferenceResponse:
    if isinstance(result, ApplianceError):
        return InferenceResponse(error=_error_of(result))
    return InferenceResponse([Tensor(n, a) for n, a in result.outputs.items()])


class InferenceRequest:
    """A request: what ``execute`` receives, and what a model builds to call another
    model (BLS: ``InferenceRequest(model_name=..., inputs=[...],
    requested_output_names=[...]).exec()``)."""

    def __init__(
        self,
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        model_name: str = "",
        model_version: int = -1,
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        parameters: dict[str, Any] | str | None = None,
        response_sender: InferenceResponseSender | None = None,
        **_ignored: Any,  # preferred_memory, trace: no meaning on a CPU device
    ) -> None:
        if isinstance(inputs, str):  # Triton's positional order: (model_name, inputs, outputs)
            given: Any = (inputs, requested_output_names, model_name)
            model_name, inputs, requested_output_names = given
        self._inputs = list(inputs or [])
        self._outputs = list(requested_output_names or [])
        self._model_name = model_name
        self._model_version = model_version
        self._id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = _json_text(parameters)
        self._sender = response_sender

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def model_name(self) -> str:
        return self._model_name

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonError(
                "get_response_sender() is for decoupled models "
                "(model_transaction_policy { decoupled: true })",
                TritonError.UNSUPPORTED,
            )
        return self._sender

    def _as_request(self) -> _Request:
        if not self._model_name:
            raise TritonError("a BLS request needs model_name", TritonError.INVALID_ARG)
        version = "" if self._model_version in (-1, 0) else str(self._model_version)
        return _Request(
            model_name=self._model_name,
            inputs={t.name(): t.as_numpy() for t in self._inputs},
            model_version=version,
            outputs=tuple(self._outputs),
            id=self._id,
            timeout_us=self._timeout or None,
        )

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on its model and wait; errors come back in the response,
        as in Triton. ``decoupled=True``: an iterator over the model's responses."""
        if decoupled:
            return self._exec_stream()
        try:
            return _response_of(bls.call(self._as_request()))
        except ApplianceError as exc:
            return _response_of(exc)

    def _exec_stream(self) -> Iterator[InferenceResponse]:
        try:
            for item in bls.call_stream(self._as_request()):
                yield _response_of(item)
        except ApplianceError as exc:
            yield _response_of(exc)

    def async_exec(self, decoupled: bool = False) -> Awaitable[InferenceResponse]:
        """:meth:`exec` as an awaitable, for ``async def execute``."""
        if decoupled:
            raise TritonError("async_exec(decoupled=True) is not supported; use exec()")

        async def run() -> InferenceResponse:
            try:
                return _response_of(await bls.call_async(self._as_request()))
            except ApplianceError as exc:
                return _response_of(exc)

        return run()


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


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
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
