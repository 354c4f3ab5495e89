"""Trace and log settings over gRPC: Triton's ``TraceSetting`` and ``LogSettings``
messages <-> the plain settings of :mod:`appliance.core.trace` and
:mod:`appliance.core.log_settings` (the HTTP form)."""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import service_pb2


def trace_changes(request: Any) -> dict[str, Any]:
    """A ``TraceSettingRequest``'s settings: a value list per key; an empty list
    clears the model's own value (None), as Triton reads it."""
    changes: dict[str, Any] = {}
    for key, setting in request.settings.items():
        values = list(setting.value)
        if not values:
            changes[key] = None
        elif key == "trace_level":
            changes[key] = values
        else:
            changes[key] = values[0] if len(values) == 1 else values
    return changes


def trace_response(settings: dict[str, Any]) -> Any:
    response = service_pb2.TraceSettingResponse()
    for key, value in settings.items():
        values = value if isinstance(value, list) else [value]
        response.settings[key].value.extend(str(v) for v in values)
    return response


def log_changes(request: Any) -> dict[str, Any]:
    return {
        key: getattr(setting, setting.WhichOneof("parameter_choice") or "string_param")
        for key, setting in request.settings.items()
    }


def log_response(settings: dict[str, Any]) -> Any:
    response = service_pb2.LogSettingsResponse()
    for key, value in settings.items():
        if isinstance(value, bool):
            response.settings[key].bool_param = value
        elif isinstance(value, int):
            response.settings[key].uint32_param = value
        else:
            response.settings[key].string_param = str(value)
    return response
