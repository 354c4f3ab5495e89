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
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from appliance import bls
from appliance.errors import ApplianceError, Code
from appliance.python_helpers import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceResponseSender,
    Logger,
    TritonError,
    TritonModelException,
    bls_parameters,
    deserialize_bytes_tensor,
    get_input_config_by_name,
    get_input_tensor_by_name,
    get_output_config_by_name,
    get_output_tensor_by_name,
    json_text,
    model_config,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
    using_decoupled_model_transaction_policy,
)
from appliance.request import InferenceRequest as _Request
from appliance.request import InferenceResponse as _Response

__all__ = [
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "Logger",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "model_config",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]


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
        self._parameters = json_text(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


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
        self._parameters = bls_parameters(parameters)
        self._sender = response_sender
        self._cancelled: Callable[[], bool] | None = None  # set by the Python backend

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
        """The request's own parameters as a JSON object (Triton's): those the client
        sent that are not the server's (``sequence_*``, ``priority``, ``timeout``,
        ``binary_data_output``, ``headers``, ``triton_*`` are not in it)."""
        return self._parameters

    def is_cancelled(self) -> bool:
        """True once the caller went away (a reset HTTP connection, a cancelled gRPC
        call or stream): the model may stop and answer with an error."""
        if self._cancelled is not None and self._cancelled():
            return True
        return self._sender is not None and self._sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender() is for requests a model receives in execute()"
            )
        return self._sender

    def _as_request(self) -> _Request:
        if not self._model_name:
            raise TritonError("a BLS request needs model_name", TritonError.INVALID_ARG)
        version = "" if self._model_version in (-1, 0) else str(self._model_version)
        parameters = json.loads(self._parameters)
        return _Request(
            model_name=self._model_name,
            inputs={t.name(): t.as_numpy() for t in self._inputs},
            model_version=version,
            outputs=tuple(self._outputs),
            id=self._id,
            timeout_us=self._timeout or None,
            parameters=parameters if isinstance(parameters, dict) else {},
        )

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on its model and wait; errors come back in the response,
        as in Triton. ``decoupled=True``: an iterator over the model's responses (its
        ``cancel()`` tells the model the caller went away)."""
        if decoupled:
            return ResponseIterator(self._exec_stream())
        try:
            return _response_of(bls.call(self._as_request()))
        except ApplianceError as exc:
            return _response_of(exc)

    def _exec_stream(self) -> Iterator[InferenceResponse]:
        try:
            items = bls.call_stream(self._as_request())
        except ApplianceError as exc:
            yield _response_of(exc)
            return
        try:
            for item in items:
                yield _response_of(item)
        except ApplianceError as exc:
            yield _response_of(exc)
        finally:
            items.close()  # early: the called model's request is cancelled

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """:meth:`exec` as an awaitable, for ``async def execute``; ``decoupled=True``
        resolves to an iterator over every response of the called model."""

        async def run() -> InferenceResponse:
            try:
                return _response_of(await bls.call_async(self._as_request()))
            except ApplianceError as exc:
                return _response_of(exc)

        async def run_stream() -> ResponseIterator:
            responses: list[InferenceResponse] = []
            try:
                async for item in bls.call_stream_async(self._as_request()):
                    responses.append(_response_of(item))
            except ApplianceError as exc:
                responses.append(_response_of(exc))
            return ResponseIterator(iter(responses))

        return run_stream() if decoupled else run()


class ResponseIterator:
    """The responses of a BLS call to a decoupled model, as they come."""

    def __init__(self, responses: Iterator[InferenceResponse]) -> None:
        self._responses = responses

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        return next(self._responses)

    def cancel(self) -> None:
        """Stop reading: the called model sees its request cancelled."""
        close = getattr(self._responses, "close", None)
        if close is not None:
            close()
