"""The KServe read-only routes, answered the same by both HTTP fronts: health, server
and model metadata, model readiness and config (:func:`answer`), and who may call each
(:data:`SCOPES`). :mod:`appliance.adapters.http.front` answers them on its own
connections (so that probes, clients' metadata calls and perf_analyzer never load
aiohttp), and the aiohttp routes of :mod:`appliance.adapters.http.api` call the same
function on connections handed over.
"""

from __future__ import annotations

import orjson

from appliance.adapters.access import Scope
from appliance.adapters.codec import kserve
from appliance.core.dataplane import DataPlane

SCOPES = {
    "live": Scope.PUBLIC,
    "ready": Scope.PUBLIC,
    "server": Scope.PUBLIC,
    "model": Scope.INFERENCE,
    "model_ready": Scope.INFERENCE,
    "model_config": Scope.INFERENCE,
}


def answer(
    dataplane: DataPlane, route: str, model: str = "", version: str = ""
) -> tuple[int, bytes]:
    """(status, JSON body; empty for a bare status) of ``route`` (a key of
    :data:`SCOPES`); raises :class:`~appliance.errors.ApplianceError` for the caller
    to map (a malformed name, a version the model lacks)."""
    if route == "live":
        return (200 if dataplane.live else 400), b""
    if route == "ready":
        return (200 if dataplane.ready() else 400), b""
    if route == "server":
        return 200, _json(dataplane.server_metadata())
    if route == "model_ready":
        # not ready, unknown model: 400 with the reason, as Triton; unknown version: 404
        reason = dataplane.model_unready_reason(model, version)
        return (400, kserve.error_body(reason)) if reason else (200, b"")
    if route == "model":
        return 200, _json(dataplane.model_metadata(model, version))
    if route == "model_config":
        return 200, _json(dataplane.model_config(model, version))
    raise KeyError(route)


def _json(doc: object) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
