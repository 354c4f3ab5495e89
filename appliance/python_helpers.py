"""The helpers of :mod:`appliance.python_model` (Triton's ``pb_utils``) that need no
request: the logger, tensor and config look-ups, type names and byte tensors."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from appliance import datatypes

_log = logging.getLogger("appliance.python_model")


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
