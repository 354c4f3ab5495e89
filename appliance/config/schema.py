"""Triton's ModelConfig protobuf message, without the gRPC stack.

``tritonclient`` ships ``model_config_pb2`` (generated from Triton's
``model_config.proto``) inside its ``tritonclient.grpc`` package, whose
``__init__`` imports grpcio. Reading a ``config.pbtxt`` needs only protobuf, so the
generated module is loaded from its file under its own full name: a later
``import tritonclient.grpc`` (the gRPC endpoint) then finds it in ``sys.modules``
and reuses it, so the message type is registered with protobuf exactly once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_NAME = "tritonclient.grpc.model_config_pb2"


def model_config_pb2() -> ModuleType:
    """The generated module (imported on first use: protobuf costs start-up time)."""
    loaded = sys.modules.get(_NAME)
    if loaded is not None:
        return loaded
    root = importlib.util.find_spec("tritonclient")
    if root is None or not root.submodule_search_locations:
        raise ImportError("tritonclient is not installed (it ships Triton's model config schema)")
    path = Path(next(iter(root.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"Triton's model config schema is missing from tritonclient: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module
