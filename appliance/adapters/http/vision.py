"""The DeepStack / CodeProject.AI detection API on the HTTP port, for NVRs (Frigate's
``deepstack`` detector, Blue Iris, Agent DVR, Home Assistant): ``POST
/v1/vision/detection`` (the ``vision:`` section's default detector) and ``POST
/v1/vision/custom/<name>`` (a detector by name).

The request is multipart form data: ``image`` (JPEG, PNG, BMP or WebP), optional
``api_key`` (the server's inference token; a bearer ``Authorization`` header works too)
and optional ``min_confidence``. The answer is DeepStack's: ``{"success": true,
"predictions": [{"label", "confidence", "x_min", "y_min", "x_max", "y_max"}]}`` in
the sent image's pixels; every refusal is ``{"success": false, "error": ...}`` with a
4xx status (503 while the model cannot serve).

Sizes are admitted before they are buffered: a declared body over
``vision.max_image_bytes`` is refused before a byte of it is read, an ``image`` part is
read chunk by chunk and refused once it passes the limit, the other fields are a few
bytes each, and the form must arrive within ``http_body_timeout_s``. The image's
header is read before its pixels: more than ``vision.max_image_pixels`` is refused
undecoded (a 100-megapixel PNG of a few kilobytes never reaches memory)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import orjson
from aiohttp import BodyPartReader, web

from appliance.adapters.access import AccessPolicy, Scope
from appliance.adapters.http import api
from appliance.adapters.http.infer import STATUS
from appliance.errors import ApplianceError, Code, invalid
from appliance.streams.manager import Streams
from appliance.vision import image
from appliance.vision.detector import Detector, Detectors

log = logging.getLogger(__name__)

DETECTORS = web.AppKey("vision_detectors", Detectors)
FIELD_BYTES = 1024  # api_key, min_confidence: a few bytes each
MAX_PARTS = 16
FORM_OVERHEAD = 64 * 1024  # multipart headers and small fields beside the image


@dataclass(slots=True)
class Form:
    access: AccessPolicy
    authorized: bool  # by a bearer header, or no token is needed
    image: bytes | bytearray | None = None
    api_key: str | None = None
    min_confidence: float | None = None


class Denied(Exception):
    """The form's ``api_key`` is not the inference token: answered 401 at once."""

    message = "a valid 'api_key' is needed (the server's inference token)"


def _answer(doc: dict[str, object], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def _refusal_body(status: int, message: str) -> bytes:
    """DeepStack's error document (also the shape of the front's refusals on these
    routes: adapters/http/routing)."""
    return orjson.dumps({"success": False, "error": message, "code": status})


def _refuse(status: int, message: str) -> web.Response:
    return web.Response(
        body=_refusal_body(status, message), status=status, content_type="application/json"
    )


async def _part(part: BodyPartReader, limit: int, what: str) -> bytearray:
    """A part's bytes, refused as soon as they pass ``limit``. Read in chunks of at most
    the limit (aiohttp reads up to two chunks ahead to find the part's end): a small
    field is checked without waiting for much of what follows it."""
    data = bytearray()
    size = max(FIELD_BYTES, min(limit, 64 * 1024))
    while True:
        chunk = await part.read_chunk(size)
        if not chunk:
            return data
        data += chunk
        if len(data) > limit:
            raise ApplianceError(Code.TOO_LARGE, f"{what} is larger than {limit} bytes")


def _text(raw: bytearray, name: str) -> str:
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise invalid(f"the form field '{name}' is not UTF-8 text") from None


def _confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:  # NaN fails both
        raise invalid(f"'min_confidence' must be a number from 0 to 1, got {text[:40]!r}")
    return value


async def _read_form(request: web.Request, form: Form, max_image: int) -> Form:
    """The form's fields, each bounded. An ``api_key`` is checked as soon as it is read:
    a wrong one ends the request before the parts after it (the image, as clients send
    it) are read."""
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError) as exc:
        raise invalid(f"expected multipart/form-data with an 'image' file: {exc}") from None
    for _ in range(MAX_PARTS + 1):
        try:
            part = await reader.next()
        except (AssertionError, ValueError, KeyError) as exc:
            raise invalid(f"malformed multipart body: {exc}") from None
        if part is None:
            return form
        if not isinstance(part, BodyPartReader):
            raise invalid("nested multipart bodies are not taken")
        name = part.name or ""
        if name == "image":
            form.image = await _part(part, max_image, "the image")
        elif name == "api_key":
            form.api_key = _text(await _part(part, FIELD_BYTES, "'api_key'"), name)
            if not form.authorized:
                if form.access.check(Scope.INFERENCE, f"Bearer {form.api_key}") is not None:
                    raise Denied
                form.authorized = True
        elif name == "min_confidence":
            text = _text(await _part(part, FIELD_BYTES, "'min_confidence'"), name)
            form.min_confidence = _confidence(text)
        else:  # CodeProject.AI's clients may send more fields: read, bounded, and let go
            await _part(part, FIELD_BYTES * 64, f"the form field {name[:40]!r}")
    raise invalid(f"the form has more than {MAX_PARTS} fields")


def _header_authorizes(access: AccessPolicy, request: web.Request) -> bool:
    """No token is needed, or the call's bearer header carries it (checked before a
    byte of the body is read)."""
    headers = request.headers.getall("Authorization", [])
    return access.check_all(Scope.INFERENCE, headers) is None


async def _detect(request: web.Request, name: str, timeout_s: float) -> web.Response:
    started = time.perf_counter()
    detectors = request.app[DETECTORS]
    detector = detectors.get(name)  # an unknown detector: 404 before the body is read
    config = detectors.config
    declared = request.content_length
    if declared is not None and declared > config.max_image_bytes + FORM_OVERHEAD:
        raise ApplianceError(
            Code.TOO_LARGE,
            f"the request body is {declared} bytes; images up to {config.max_image_bytes} "
            f"bytes are taken (vision.max_image_bytes)",
        )
    if request.content_type != "multipart/form-data":
        raise invalid(f"expected multipart/form-data, got {request.content_type!r}")
    # the body held against the model's and the server's queued bytes before it is read
    # (503 at once when they are full), as an inference's is: appliance.core.queue_bytes
    dataplane = request.app[api.DATAPLANE]
    ticket = dataplane.admit(detector.config.model, "", declared or config.max_image_bytes)
    access = request.app[api.ACCESS]
    form = Form(access, _header_authorizes(access, request))
    try:
        try:
            await asyncio.wait_for(_read_form(request, form, config.max_image_bytes), timeout_s)
        except asyncio.TimeoutError:
            return _refuse(408, f"the form did not arrive within {timeout_s:g}s")
        except Denied:
            return _refuse(401, Denied.message)
        return await _answer_form(form, detector, config.max_image_pixels, started)
    finally:
        ticket.release()


async def _answer_form(
    form: Form, detector: Detector, max_pixels: int, started: float
) -> web.Response:
    if not form.authorized:  # no api_key in the form, and no header that carries it
        return _refuse(401, Denied.message)
    if form.image is None:
        raise invalid("the form needs an 'image' file (multipart/form-data)")
    frame = await asyncio.to_thread(image.decode, form.image, max_pixels)
    inferred = time.perf_counter()
    predictions = await detector.detect(frame, form.min_confidence)
    done = time.perf_counter()
    return _answer(
        {
            "success": True,
            "predictions": predictions,
            "count": len(predictions),
            "message": f"Found {len(predictions)} objects" if predictions else "No objects found",
            "inferenceMs": round((done - inferred) * 1000),
            "processMs": round((done - started) * 1000),
            "code": 200,
        }
    )


def register(
    app: web.Application, detectors: Detectors | None, body_timeout_s: float, streams: Streams
) -> None:
    """The routes, on ``app`` (before its runner is set up): ``GET /v1/streams`` (each
    stream's status; inference scope), and without a ``vision:`` section nothing else.
    The detection routes' scope is public at the middleware: the handler checks
    ``api_key`` (or a bearer header) itself, as DeepStack clients send it in the form."""

    async def status(request: web.Request) -> web.Response:
        return _answer({"streams": streams.status()})

    resource = app.router.add_resource("/v1/streams")
    app[api.SCOPES][resource.add_route("GET", status)] = Scope.INFERENCE
    if detectors is None:
        return
    app[DETECTORS] = detectors
    scopes = app[api.SCOPES]

    async def detection(request: web.Request) -> web.Response:
        try:
            return await _detect(request, request.match_info.get("model", ""), body_timeout_s)
        except ApplianceError as exc:
            return _refuse(STATUS[exc.code], exc.message)

    for path in ("/v1/vision/detection", "/v1/vision/custom/{model}"):
        resource = app.router.add_resource(path)
        route = resource.add_route("POST", detection)
        scopes[route] = Scope.PUBLIC
        app[api.SHAPES][route] = _refusal_body
