"""KServe v2 HTTP/REST adapter (Triton-compatible), a thin layer over the data plane.

Routes decode the wire into data-plane calls and map :class:`ApplianceError`
codes to HTTP statuses as Triton does; every error body is ``{"error": msg}``.
Access (bearer tokens, :mod:`appliance.adapters.access`) is checked by a middleware before
any route runs: 401 without a valid token, 403 where admin calls are disabled. Each
route's scope is declared where :func:`create_app` registers it; a route registered
without one counts as admin (never open by omission).
Body sizes and read timeouts are :mod:`appliance.adapters.http.limits`; an inference
request is admitted once (:meth:`DataPlane.admit`) and its body checked against the
model through that ticket before any tensor in it is decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web, web_protocol
from aiohttp.typedefs import Middleware

from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.codec import kserve
from appliance.adapters.http import generate as http_generate
from appliance.adapters.http import infer as http_infer
from appliance.adapters.http import limits as http_limits
from appliance.adapters.http import openai, reads, shadow
from appliance.adapters.http.routing import Shape
from appliance.core.dataplane import DataPlane
from appliance.errors import ApplianceError, invalid

log = logging.getLogger(__name__)

DATAPLANE = web.AppKey("dataplane", DataPlane)
MAX_REQUEST_SIZE = web.AppKey("max_request_size", int)
ACCESS = web.AppKey("access", AccessPolicy)
# every registered route -> who may call it (declared with the route in create_app)
SCOPES = web.AppKey("scopes", dict)
# a route of another API than KServe -> the shape of its errors (adapters/http/routing)
SHAPES = web.AppKey("shapes", dict)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
    )


def _error(status: int, message: str, request: web.Request | None = None) -> web.Response:
    """An error in KServe's shape, or in that of ``request``'s route's API."""
    shape = _shape(request) if request is not None else None
    body = shape(status, message) if shape is not None else kserve.error_body(message)
    return web.Response(body=body, status=status, content_type="application/json")


def _shape(request: web.Request) -> Shape | None:
    route = request.match_info.route
    return request.app[SHAPES].get(route) if route is not None else None


def _front(limits: http_limits.BodyLimits) -> Middleware:
    """The one middleware every request passes: who may call (bearer tokens by
    route scope), the body limits (413 at once, 408 when the body is late), and
    errors mapped to their status codes (a bug answers 500 and the server keeps
    serving). One coroutine frame instead of three on the hot path."""

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            denial = _denied(request)
            if denial is not None:
                return denial
            refusal = limits.refuse(request, _shape(request))
            if refusal is not None:
                return refusal
            return await handler(request)
        except http_limits.BodyTimeout:
            return limits.timed_out(request, _shape(request))
        except (ConnectionResetError, web_protocol.RequestPayloadError) as exc:
            # the client went away or broke off its body: its event, not a server error
            # (re-raised, aiohttp would log it as an error with a traceback)
            log.debug(
                "client %s left: %s %s: %s", request.remote, request.method, request.path, exc
            )
            return _error(400, f"the request body was cut off: {exc}", request)
        except ApplianceError as exc:
            return _error(http_infer.STATUS[exc.code], exc.message, request)
        except web.HTTPRequestEntityTooLarge as exc:
            return _error(
                413,
                f"request body exceeds the server's limit of "
                f"{request.app[MAX_REQUEST_SIZE]} bytes ({exc.text})",
                request,
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, f"{exc.reason}: {request.method} {request.path}", request)
            if "Allow" in exc.headers:  # a 405 says which methods the route takes
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Exception as exc:  # a bug: answer 500 and keep serving
            log.exception("unhandled error on %s %s", request.method, request.path)
            return _error(500, f"internal error: {exc}", request)

    return front


def _denied(request: web.Request) -> web.Response | None:
    """401/403 when the route's scope needs a token the call lacks, else None."""
    info = request.match_info
    if info.http_exception is not None:  # no route matched: a 404/405 with no handler
        scope = Scope.INFERENCE
    else:  # a route registered without a declared scope is an admin route
        scope = request.app[SCOPES].get(info.route, Scope.ADMIN)
    denial = request.app[ACCESS].check_all(scope, request.headers.getall("Authorization", []))
    if denial is None:
        return None
    if denial.forbidden:
        return _error(403, denial.message, request)
    response = _error(401, denial.message, request)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("model", ""), request.match_info.get("version", "")


async def _json_body(request: web.Request) -> dict[str, Any]:
    body = await http_limits.body(request)
    if not body:
        return {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object")
    return doc


async def _read(request: web.Request, route: str) -> web.Response:
    """A read-only route (:mod:`appliance.adapters.http.reads`, as the front answers it)."""
    status, body = reads.answer(request.app[DATAPLANE], route, *_model(request))
    if not body:
        return web.Response(status=status)
    return web.Response(body=body, status=status, content_type="application/json")


def _reader(route: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _read(request, route)

    handler.__name__ = route
    return handler


async def model_stats(request: web.Request) -> web.Response:
    name = request.match_info.get("model", "")
    return _json(request.app[DATAPLANE].statistics(name, request.match_info.get("version", "")))


async def infer(request: web.Request) -> web.Response:
    """An inference on a connection aiohttp serves (one handed over by
    :mod:`appliance.adapters.http.front`, which serves the ordinary ones itself)."""
    dataplane = request.app[DATAPLANE]
    model, version = _model(request)
    # one admission, before the body is read: the model version, its rules and a hold
    # on the queued bytes the request declares (an overloaded model or server answers
    # 503 without taking the payload into memory: appliance.core.queue_bytes)
    ticket = dataplane.admit(model, version, request.content_length or 0)
    try:
        body = await http_limits.body(request)
        parts, length = await http_infer.answer(
            dataplane,
            ticket,
            model,
            version,
            body,
            request.headers.get(kserve.HEADER_LENGTH),
            headers=request.headers.items(),
        )
    finally:
        ticket.release()
    out = b"".join(parts)  # a lone part: join returns it, no copy
    if length is None:
        return web.Response(body=out, content_type=http_infer.JSON)
    return web.Response(
        body=out,
        content_type=http_infer.BINARY,
        headers={kserve.HEADER_LENGTH: str(length)},
    )


async def repository_index(request: web.Request) -> web.Response:
    doc = await _json_body(request)
    ready_only = doc.get("ready", False)
    if not isinstance(ready_only, bool):
        raise invalid("'ready' must be true or false")
    return _json(request.app[DATAPLANE].repository_index(ready_only))


async def model_list(request: web.Request) -> web.Response:
    """``GET /v2/models``: not a KServe route (Triton answers it with a bare 400);
    here it lists the repository, as ``POST /v2/repository/index`` does."""
    return _json({"models": request.app[DATAPLANE].repository_index()})


async def repository_load(request: web.Request) -> web.Response:
    doc = await _json_body(request)
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("'parameters' must be an object")
    await request.app[DATAPLANE].load_model(request.match_info["model"], params)
    return web.Response(status=200)


async def repository_unload(request: web.Request) -> web.Response:
    await _json_body(request)  # parameters such as unload_dependents are accepted, unused
    await request.app[DATAPLANE].unload_model(request.match_info["model"])
    return web.Response(status=200)


# ---- system shared memory (Triton's extension) ---------------------------------------


async def shm_status(request: web.Request) -> web.Response:
    name = request.match_info.get("region", "")
    return _json(request.app[DATAPLANE].shared_memory.status(name))


async def shm_register(request: web.Request) -> web.Response:
    name = request.match_info["region"]
    doc = await _json_body(request)
    where = f"register shared-memory region '{name}'"
    key = doc.get("key")
    if not isinstance(key, str) or not key:
        raise invalid(f"{where}: the body needs a 'key' string (the POSIX shm name)")
    sizes = {"offset": doc.get("offset", 0), "byte_size": doc.get("byte_size")}
    for field, value in sizes.items():
        if value is None:
            raise invalid(f"{where}: the body needs '{field}'")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid(f"{where}: '{field}' must be a non-negative integer, got {value!r}")
    request.app[DATAPLANE].shared_memory.register(name, key, sizes["offset"], sizes["byte_size"])
    return web.Response(status=200)


async def shm_unregister(request: web.Request) -> web.Response:
    await _json_body(request)  # tritonclient sends an empty body
    request.app[DATAPLANE].shared_memory.unregister(request.match_info.get("region", ""))
    return web.Response(status=200)


# ---- trace and logging (Triton's extensions) -----------------------------------------


async def trace_setting(request: web.Request) -> web.Response:
    model = request.match_info.get("model", "")
    tracer = request.app[DATAPLANE].tracer
    if model:
        request.app[DATAPLANE].lifecycle.entry(model)  # Triton's error for an unknown model
    if request.method == "GET":
        return _json(tracer.settings(model))
    return _json(tracer.update(await _json_body(request), model))


async def log_setting(request: web.Request) -> web.Response:
    settings = request.app[DATAPLANE].log_settings
    if request.method == "GET":
        return _json(settings.settings())
    return _json(settings.update(await _json_body(request)))


# ---- CUDA shared memory (Triton's extension; see appliance.core.cuda_shared_memory) -------


async def cuda_shm_status(request: web.Request) -> web.Response:
    name = request.match_info.get("region", "")
    return _json(request.app[DATAPLANE].cuda_shared_memory.status(name))


async def cuda_shm_register(request: web.Request) -> web.Response:
    name = request.match_info["region"]
    doc = await _json_body(request)
    device, size = doc.get("device_id", 0), doc.get("byte_size", 0)
    if not isinstance(device, int) or not isinstance(size, int):
        raise invalid(f"register CUDA shared-memory region '{name}': expected integers")
    request.app[DATAPLANE].cuda_shared_memory.register(name, device, size)
    return web.Response(status=200)


async def cuda_shm_unregister(request: web.Request) -> web.Response:
    await _json_body(request)
    request.app[DATAPLANE].cuda_shared_memory.unregister(request.match_info.get("region", ""))
    return web.Response(status=200)


async def _close_when_stopping(request: web.Request, response: web.StreamResponse) -> None:
    """Shutting down: tell keep-alive clients not to send another request on this
    connection (``Connection: close``); the server closes it after this answer."""
    if not request.app[DATAPLANE].accepting:
        response.force_close()


def create_app(
    dataplane: DataPlane,
    max_request_size: int,
    access: AccessPolicy | None = None,
    body_timeout_s: float = 60.0,
) -> web.Application:
    limits = http_limits.BodyLimits(max_request_size, body_timeout_s)
    app = web.Application(client_max_size=max_request_size, middlewares=[_front(limits)])
    app[DATAPLANE] = dataplane
    app[MAX_REQUEST_SIZE] = max_request_size
    app[ACCESS] = access or AccessPolicy()
    app.on_response_prepare.append(_close_when_stopping)
    scopes: dict[web.AbstractRoute, Scope] = {}
    app[SCOPES] = scopes
    shapes: dict[web.AbstractRoute, Shape] = {}
    app[SHAPES] = shapes
    expect = http_limits.expect_handler(max_request_size, _shape)
    inference, admin = Scope.INFERENCE, Scope.ADMIN

    def declare(route: web.AbstractRoute, scope: Scope, shape: Shape | None) -> None:
        scopes[route] = scope
        if shape is not None:
            shapes[route] = shape

    def get(path: str, handler: Handler, scope: Scope, shape: Shape | None = None) -> None:
        resource = app.router.add_resource(path)
        declare(resource.add_route("HEAD", handler), scope, shape)
        declare(resource.add_route("GET", handler), scope, shape)

    def post(path: str, handler: Handler, scope: Scope, shape: Shape | None = None) -> None:
        resource = app.router.add_resource(path)
        declare(resource.add_route("POST", handler, expect_handler=expect), scope, shape)

    # inference first: routes that share a prefix are tried in the order they were
    # added, and this is the one every request of the hot path takes
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        post(base + "/infer", infer, inference)
    get("/v2", _reader("server"), reads.SCOPES["server"])
    get("/v2/", _reader("server"), reads.SCOPES["server"])  # the KServe spec's spelling
    get("/v2/health/live", _reader("live"), reads.SCOPES["live"])
    get("/v2/health/ready", _reader("ready"), reads.SCOPES["ready"])
    get("/v2/models", model_list, inference)
    get("/v2/models/stats", model_stats, inference)  # before /v2/models/{model}
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        get(base, _reader("model"), reads.SCOPES["model"])
        get(base + "/ready", _reader("model_ready"), reads.SCOPES["model_ready"])
        get(base + "/config", _reader("model_config"), reads.SCOPES["model_config"])
        get(base + "/stats", model_stats, inference)
        get(base + "/trace/setting", trace_setting, admin)
        post(base + "/trace/setting", trace_setting, admin)
    get("/v2/trace/setting", trace_setting, admin)
    post("/v2/trace/setting", trace_setting, admin)
    get("/v2/logging", log_setting, admin)
    post("/v2/logging", log_setting, admin)
    post("/v2/repository/index", repository_index, inference)
    post("/v2/repository/models/{model}/load", repository_load, admin)
    post("/v2/repository/models/{model}/unload", repository_unload, admin)
    shadow.routes(DATAPLANE, get, post, _json_body, _json)
    http_generate.routes(DATAPLANE, post)  # Triton's generate extension
    openai.routes(DATAPLANE, get, post)  # the OpenAI-compatible API under /v1
    shm = "/v2/systemsharedmemory"
    get(shm + "/status", shm_status, inference)
    get(shm + "/region/{region}/status", shm_status, inference)
    post(shm + "/region/{region}/register", shm_register, admin)
    post(shm + "/unregister", shm_unregister, admin)
    post(shm + "/region/{region}/unregister", shm_unregister, admin)
    cuda = "/v2/cudasharedmemory"
    get(cuda + "/status", cuda_shm_status, inference)
    get(cuda + "/region/{region}/status", cuda_shm_status, inference)
    post(cuda + "/region/{region}/register", cuda_shm_register, admin)
    post(cuda + "/unregister", cuda_shm_unregister, admin)
    post(cuda + "/region/{region}/unregister", cuda_shm_unregister, admin)
    return app
