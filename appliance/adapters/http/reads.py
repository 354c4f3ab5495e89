"""The KServe read-only routes, answered the same by both HTTP fronts: health, server
and model metadata, model readiness and config (:func:`answer`), who may call each
(:data:`SCOPES`), the table a front answers from (:func:`routes`) and its answer to
one request (:func:`respond`). :mod:`appliance.adapters.http.front` answers them on its own
connections (so that probes, clients' metadata calls and perf_analyzer never load
aiohttp), and the aiohttp routes of :mod:`appliance.adapters.http.api` call the same
function on connections handed over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import orjson

from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.codec import kserve
from appliance.adapters.http.head import Head
from appliance.adapters.http.infer import STATUS
from appliance.core.dataplane import DataPlane
from appliance.errors import ApplianceError

JSON = b"application/json"

# a read-only route's answer: status, body (empty for a bare status), content type
Read = tuple[int, bytes, bytes]
# the read-only routes (head.ROUTES) a front answers itself: who may call each, and
# the answer (raising ApplianceError for the front to map)
Routes = Mapping[str, tuple[Scope, Callable[[Head], Read]]]

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


def routes(dataplane: DataPlane) -> Routes:
    """The KServe read-only routes, as the HTTP endpoint's front answers them."""

    def route(name: str) -> Callable[[Head], Read]:
        def read(head: Head) -> Read:
            status, body = answer(dataplane, name, head.model, head.version)
            return status, body, JSON

        return read

    return {name: (scope, route(name)) for name, scope in SCOPES.items()}


def respond(routes: Routes, access: AccessPolicy, head: Head) -> Read:
    """The answer to ``head``, a request for one of ``routes``: 401/403 for a token
    its scope needs, the route's answer, or its error mapped to a status."""
    scope, answer_route = routes[head.route]
    denial = access.check_all(scope, head.authorizations)
    if denial is not None:
        return (403 if denial.forbidden else 401), kserve.error_body(denial.message), JSON
    try:
        return answer_route(head)
    except ApplianceError as exc:
        return STATUS[exc.code], kserve.error_body(exc.message), JSON


def _json(doc: object) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
