"""Whether the gRPC endpoint's libraries load, and what to tell the user when not.

The gRPC endpoint, ``appliance perf -i grpc`` and ``appliance doctor`` need grpcio and
tritonclient's generated service modules, which need a protobuf runtime of the
release they were made for. Any of these can be missing or mismatched on a device
(an install without the ``grpc`` extra, a later ``pip install`` that moved grpcio or
protobuf): the import then fails with ImportError, tritonclient's RuntimeError ("The
installation does not include grpc support") or protobuf's VersionError. Each caller
turns that into one line naming the fix, never a traceback.
"""

from __future__ import annotations

FIX = "pip install 'appliance[grpc]'"


def why(exc: BaseException) -> str:
    """An import failure as one line: its type and the first line of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_error() -> str | None:
    """None when grpcio and Triton's service modules import, else why not (one line)."""
    try:
        import grpc  # noqa: F401
        from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: F401
    except Exception as exc:  # whatever stops the import: see the module docstring
        return why(exc)
    return None


def missing() -> str | None:
    """None when grpcio, protobuf and Triton's service modules are installed, else what
    is not (one line), found without importing them: the gRPC endpoint imports them
    only with its first connection, and a runtime that does not match the generated
    code (protobuf's VersionError) shows then, in the log."""
    import importlib.util
    from pathlib import Path

    try:
        for name in ("grpc", "google.protobuf", "tritonclient"):
            if importlib.util.find_spec(name) is None:
                return f"ModuleNotFoundError: No module named '{name}'"
        spec = importlib.util.find_spec("tritonclient")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        if not any((Path(f) / "grpc" / "service_pb2.py").is_file() for f in folders):
            return "tritonclient has no gRPC support (its grpc/service_pb2.py is missing)"
    except Exception as exc:  # a finder that fails: as load_error() reports it
        return why(exc)
    return None
