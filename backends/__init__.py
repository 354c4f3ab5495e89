"""Inference backends, chosen by name with lazy import.

Importing this package imports no engine: each backend module is imported the
first time a model asks for it, so a device without OpenVINO or TensorRT still
serves ONNX models, and a model that needs a missing engine fails to load with a
message naming the extra to install.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from appliance.errors import invalid
from backends.base import Backend, BackendOptions, TensorSpec

# backend name -> (module:class, pip extra that provides its engine)
BACKENDS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("backends.onnxruntime_backend:OnnxRuntimeBackend", "appliance"),
}

# Triton platform names -> backend names
PLATFORMS: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
}

# default model file name of each backend (Triton's default_model_filename)
DEFAULT_FILENAMES: dict[str, str] = {
    "onnxruntime": "model.onnx",
}

# model file suffix -> backend, used when a config names neither backend nor platform
BY_SUFFIX: dict[str, str] = {
    ".onnx": "onnxruntime",
}


def backend_for_file(path: Path) -> str | None:
    return BY_SUFFIX.get(path.suffix)


def create(name: str, options: BackendOptions) -> Backend:
    """Create one instance of backend ``name`` (blocking: call from a worker thread)."""
    try:
        target, extra = BACKENDS[name]
    except KeyError:
        raise invalid(
            f"unknown backend '{name}', expected one of {', '.join(sorted(BACKENDS))}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise invalid(
            f"backend '{name}' needs a package that is not installed ({exc.name}); "
            f"install it with: pip install '{extra}'"
        ) from None
    cls = getattr(module, class_name)
    backend: Backend = cls(options)
    return backend


__all__ = ["BACKENDS", "Backend", "BackendOptions", "TensorSpec", "create"]
