"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and
``.../generate_stream``, for any model (a language model, any decoupled or regular one).

As Triton documents and tests it (``docs/protocol/extension_generate.md``):

- the body is one JSON object; a member named like one of the model's inputs becomes
  that input (a string, number or boolean, or a flat array of them, shaped to the
  input's dims: the one ``-1`` takes the count, a batching model gets a batch of 1);
  ``parameters`` (an object) and every other member become request parameters (a
  string, number or boolean each; anything else is refused);
- a member given twice is refused (``input 'X' already exists in request``), a wrong
  JSON type with Triton's words (``attempt to access JSON non-string as string``), a
  request missing required inputs with ``expected N inputs but got M inputs``;
- ``generate`` answers exactly one JSON object: ``model_name``, ``model_version`` and
  each output by name (one element: the value, a string for BYTES; more: a list); a
  model that sends no response or more than one is an error;
- ``generate_stream`` answers Server-Sent Events, one ``data:`` event per response
  and ``data: {"error": ...}`` for an error; an error before the first response is
  answered with its status code (still as an event), a request refused before it ran
  as an ordinary JSON error.

The model is admitted before the body is read (:meth:`DataPlane.admit`), as every
inference is; a client that leaves a stream cancels the generation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from appliance import datatypes
from appliance.adapters.access import Scope
from appliance.adapters.http import infer, limits, sse
from appliance.config.model_config import ModelConfig
from appliance.core.dataplane import DataPlane
from appliance.errors import ApplianceError, invalid
from appliance.request import InferenceRequest, InferenceResponse

Register = Callable[[str, Callable[[web.Request], Any], Scope], None]
JSON_KINDS = {"BOOL": "boolean", "BYTES": "string"}
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream instead "
    "for decoupled models"
)


class _Object(list[tuple[str, Any]]):
    """A JSON object's members in order, duplicates kept (Triton refuses a duplicate
    input, which a dict would hide)."""


def parse_body(body: bytes | bytearray) -> _Object:
    """The request object's members in order (duplicates kept)."""
    try:
        doc = json.loads(body or b"{}", object_pairs_hook=_Object)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(doc, _Object):
        raise invalid("the request body must be a JSON object")
    return doc


def _parameter(name: str, value: Any) -> str | int | float | bool:
    if isinstance(value, (str, int, float, bool)) and not isinstance(value, _Object):
        return value
    raise invalid(
        f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'."
    )


def _element(value: Any, datatype: str, name: str) -> Any:
    """One JSON value as an element of ``datatype``, with Triton's words when not."""
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise invalid(f"attempt to access JSON non-string as string (input '{name}')")
        return value.encode()
    if datatype == "BOOL":
        if not isinstance(value, bool):
            raise invalid(f"attempt to access JSON non-boolean as boolean (input '{name}')")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"attempt to access JSON non-number as number (input '{name}')")
    if datatype[0] in "IU" and not isinstance(value, int):
        raise invalid(f"attempt to access JSON non-integer as integer (input '{name}')")
    return value


def _tensor(
    value: Any, datatype: str, dims: tuple[int, ...], batched: bool, name: str
) -> np.ndarray:
    values = value if isinstance(value, list) else [value]
    elements = [_element(v, datatype, name) for v in values]
    dtype = np.object_ if datatype == "BYTES" else datatypes.to_numpy_dtype(datatype)
    try:
        arr = np.array(elements, dtype=dtype)
    except (OverflowError, ValueError) as exc:
        raise invalid(f"input '{name}': {exc}") from None
    fixed = int(np.prod([d for d in dims if d >= 0], dtype=np.int64))
    shape = list(dims)
    if -1 in shape:
        first = shape.index(-1)
        shape = [1 if d < 0 else d for d in shape]
        shape[first] = len(elements) // fixed if fixed and len(elements) % fixed == 0 else -1
    if -1 in shape or int(np.prod(shape, dtype=np.int64)) != len(elements):
        raise invalid(
            f"input '{name}': {len(elements)} element(s) do not fit its dims {list(dims)}"
        )
    return arr.reshape(([1] if batched else []) + shape)


def build_request(members: _Object, config: ModelConfig, version: str) -> InferenceRequest:
    """The body's members -> the model's inputs and the request's parameters."""
    specs = {t.name: t for t in config.inputs}
    inputs: dict[str, np.ndarray] = {}
    parameters: dict[str, str | int | float | bool] = {}
    for name, value in members:
        if name == "parameters" and name not in specs:
            if not isinstance(value, _Object):
                raise invalid("'parameters' must be an object")
            for key, item in value:
                parameters[key] = _parameter(key, item)
            continue
        spec = specs.get(name)
        if spec is None:
            parameters[name] = _parameter(name, value)
            continue
        if name in inputs:
            raise invalid(f"input '{name}' already exists in request")
        if isinstance(value, _Object):
            value = dict(value)  # an object: not a tensor's value (refused as one)
        inputs[name] = _tensor(value, spec.datatype, spec.dims, config.batch_size > 0, name)
    required = sum(1 for t in config.inputs if not t.optional)
    given = len(inputs)
    if given < required or given > len(specs):
        expected = (
            f"{required}"
            if required == len(specs)
            else f"number of inputs between {required} and {len(specs)}"
        )
        raise invalid(
            f"expected {expected} inputs but got {given} inputs for model '{config.name}'"
        )
    return InferenceRequest(config.name, inputs, version, parameters=parameters)


def response_json(response: InferenceResponse) -> dict[str, Any]:
    """Triton's generate response: the model and version, each output by name."""
    out: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    for name, arr in response.outputs.items():
        flat = arr.reshape(-1)
        values = [
            v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in flat.tolist()
        ]
        out[name] = values[0] if len(values) == 1 else values
    return out


def _error_body(exc: ApplianceError) -> bytes:
    return orjson.dumps({"error": exc.message})


async def _admitted(request: web.Request, dataplane: DataPlane) -> tuple[InferenceRequest, Any]:
    """The request admitted (before its body is read) and built from its body."""
    model, version = request.match_info["model"], request.match_info.get("version", "")
    ticket = dataplane.admit(model, version, request.content_length or 0)
    try:
        members = parse_body(await limits.body(request))
        built = build_request(members, ticket.servable.config, version)
        sse.declare(ticket, built.inputs)
    except BaseException:
        ticket.release()
        raise
    return built, ticket


def routes(key: web.AppKey[DataPlane], post: Register) -> None:
    """Register the two routes (inference scope) with ``post``."""

    async def generate(request: web.Request) -> web.Response:
        dataplane = request.app[key]
        built, ticket = await _admitted(request, dataplane)
        try:
            answers = [r async for r in sse.responses(dataplane, built, ticket)]
        finally:
            ticket.release()
        errors = [a for a in answers if isinstance(a, ApplianceError)]
        if errors:
            raise errors[0]
        if len(answers) != 1:
            raise invalid(ONE_RESPONSE)
        only = answers[0]
        assert isinstance(only, InferenceResponse)
        return web.Response(body=orjson.dumps(response_json(only)), content_type=infer.JSON)

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        dataplane = request.app[key]
        built, ticket = await _admitted(request, dataplane)
        response: web.StreamResponse | None = None
        items = sse.responses(dataplane, built, ticket)
        try:
            async for item in items:
                if response is None:  # the first one sets the status
                    status = infer.STATUS[item.code] if isinstance(item, ApplianceError) else 200
                    response = await sse.open_events(request, status)
                if isinstance(item, ApplianceError):
                    await sse.event(response, _error_body(item))
                else:
                    await sse.event(response, orjson.dumps(response_json(item)))
        except sse.GONE:
            pass  # the client left: closing the responses cancels the generation
        finally:
            await items.aclose()
            ticket.release()
        if response is None:  # the model sent no response with outputs
            response = await sse.open_events(request)
        await response.write_eof()
        return response

    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        post(base + "/generate", generate, Scope.INFERENCE)
        post(base + "/generate_stream", generate_stream, Scope.INFERENCE)
