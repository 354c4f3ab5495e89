"""HTTP routes of shadow traffic (:mod:`appliance.core.shadow`), beside Triton's
repository extension: ``POST /v2/repository/models/{m}/shadow`` with
``{"parameters": {"version": N, "sample_rate", "max_in_flight", "max_requests"}}``
starts mirroring a sample of the model's unversioned traffic to its loaded version N
(admin scope); ``GET`` on the same path reads the agreement so far (the scope of
statistics). :func:`routes` is called by :func:`appliance.adapters.http.api.create_app`
with its route registration and JSON helpers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from appliance.adapters.access import Scope
from appliance.core.dataplane import DataPlane
from appliance.errors import invalid

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Register = Callable[[str, Handler, Scope], None]


def routes(
    dataplane: web.AppKey[DataPlane],
    get: Register,
    post: Register,
    body: Callable[[web.Request], Awaitable[dict[str, Any]]],
    respond: Callable[[Any], web.Response],
) -> None:
    async def start(request: web.Request) -> web.Response:
        params = (await body(request)).get("parameters")
        if not isinstance(params, dict):
            raise invalid("'parameters' must be an object naming the candidate 'version'")
        return respond(request.app[dataplane].start_shadow(request.match_info["model"], params))

    async def report(request: web.Request) -> web.Response:
        return respond(request.app[dataplane].shadow_report(request.match_info["model"]))

    post("/v2/repository/models/{model}/shadow", start, Scope.ADMIN)
    get("/v2/repository/models/{model}/shadow", report, Scope.INFERENCE)
