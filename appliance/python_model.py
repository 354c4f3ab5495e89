"""What a Python model's ``model.py`` imports: a small stand-in for Triton's
``triton_python_backend_utils``.

Port a Triton Python model by changing its import to
``from appliance import python_model as pb_utils``; the names it uses most
(``Tensor``, ``InferenceRequest``, ``InferenceResponse``,
``get_input_tensor_by_name``, ``get_output_config_by_name``,
``triton_string_to_numpy``, ``TritonError``) behave as Triton's do. Tensors are
numpy arrays (``as_numpy``); there is no DLPack and no GPU tensor.

One difference from Triton: the appliance's batcher gathers the requests it
batches into one tensor per input, so ``execute`` receives one request whose
tensors hold every row of the batch, and returns one response with as many rows.
A model that loops over ``requests`` and handles whole tensors works unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from appliance import datatypes


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

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    """A named numpy array."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceRequest:
    """The inputs of one execution and the outputs asked for."""

    def __init__(self, inputs: list[Tensor], requested_output_names: list[str]) -> None:
        self._inputs = inputs
        self._outputs = requested_output_names

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs


class InferenceResponse:
    """The outputs of one request, or the error that replaced them."""

    def __init__(
        self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None
    ) -> None:
        self._outputs = output_tensors or []
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def triton_string_to_numpy(config_type: str) -> Any:
    """``TYPE_FP32`` -> ``numpy.float32`` (``TYPE_STRING`` -> ``numpy.object_``)."""
    return datatypes.to_numpy_dtype(datatypes.from_config_type(config_type)).type


def model_config(args: dict[str, str]) -> dict[str, Any]:
    """The model config ``initialize`` received, parsed (``json.loads(args["model_config"])``)."""
    parsed: dict[str, Any] = json.loads(args["model_config"])
    return parsed
