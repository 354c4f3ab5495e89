"""Inference backends, chosen by name with lazy import.

Importing this package imports no engine: each backend module is imported the
first time a model asks for it, so a device without OpenVINO or TensorRT still
serves ONNX models, and a model that needs a missing engine fails to load with a
message naming the extra to install.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from appliance.backends.base import Backend, BackendOptions, TensorSpec, batch_limit
from appliance.errors import invalid

# backend name -> (module:class, pip extra of this package that provides its engine;
# "" for an engine that is a core dependency)
BACKENDS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("appliance.backends.onnxruntime_backend:OnnxRuntimeBackend", ""),
    "openvino": ("appliance.backends.openvino_backend:OpenVinoBackend", "openvino"),
    "tensorrt": ("appliance.backends.tensorrt_backend:TensorRtBackend", "tensorrt"),
    "python": ("appliance.backends.python_backend:PythonBackend", ""),
    "llm": ("appliance.backends.llm_backend:LlmBackend", "llm"),
    "identity": ("appliance.backends.identity_backend:IdentityBackend", ""),
}

# backends that serve from the config alone, with no model file (Triton's identity)
FILELESS = frozenset({"identity"})

# Triton platform names -> backend names
PLATFORMS: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
}

# default model file name of each backend (Triton's default_model_filename)
DEFAULT_FILENAMES: dict[str, str] = {
    "onnxruntime": "model.onnx",
    "openvino": "model.xml",
    "tensorrt": "model.plan",
    "python": "model.py",
    "llm": "model.gguf",
}

# model file suffix -> backend, used when a config names neither backend nor platform.
# OpenVINO IR is model.xml plus its weights, model.bin (which is never a model itself).
BY_SUFFIX: dict[str, str] = {
    ".onnx": "onnxruntime",
    ".xml": "openvino",
    ".plan": "tensorrt",
    ".engine": "tensorrt",
    ".py": "python",
    ".gguf": "llm",
}


def install_hint(name: str) -> str:
    """The pip command that provides backend ``name``'s engine."""
    extra = BACKENDS[name][1]
    return f"pip install 'appliance[{extra}]'" if extra else "pip install appliance"


def backend_for_file(path: Path) -> str | None:
    return BY_SUFFIX.get(path.suffix)


def auto_max_batch_size(backend: object, default: int) -> int:
    """The max_batch_size auto-complete gives a model: the server's default, capped by
    the engine's own limit where it has one (a TensorRT optimization profile)."""
    limit = batch_limit(backend)
    return min(default, limit) if limit else default


def estimate(name: str, path: Path, parameters: dict[str, str], source: str = "") -> int:
    """What one instance of backend ``name`` is expected to need before it is built:
    the model file's size (a language model: its weights plus its KV cache)."""
    if name in FILELESS:
        return 0
    if name == "llm":
        from appliance.backends import llm_settings  # no engine import: settings and file sizes

        return llm_settings.estimate(path.parent.parent.name, path, parameters, source)
    return path.stat().st_size


def create(name: str, options: BackendOptions) -> Backend:
    """Create one instance of backend ``name`` (blocking: call from a worker thread)."""
    try:
        target, _ = BACKENDS[name]
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
            f"install it with: {install_hint(name)}"
        ) from None
    cls = getattr(module, class_name)
    backend: Backend = cls(options)
    return backend


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendOptions",
    "TensorSpec",
    "auto_max_batch_size",
    "backend_for_file",
    "create",
    "estimate",
    "install_hint",
]
