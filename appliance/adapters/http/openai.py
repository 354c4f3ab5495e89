"""The OpenAI-compatible API on the HTTP port: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``, plain and streamed, for the official ``openai`` client.

A model serves here when it takes text the way Triton's vLLM backend does: a BYTES
input ``text_input`` (completions) or ``messages`` (chat: the JSON list of messages,
which the model puts through its own chat template), and a BYTES output
``text_output``; ``stop`` (BYTES [-1]) where the model has it; ``finish_reason``,
``num_input_tokens`` and ``num_output_tokens`` outputs, where it has them, give the
finish reason and ``usage``. The ``llm`` backend is such a model; a Python model can
be one too.

Request fields: ``model``, ``prompt`` (a string, or a list of one) or ``messages``
(``content`` a string or a list of text parts), ``max_tokens`` (chat:
``max_completion_tokens`` too), ``temperature``, ``top_p``, ``stop`` (a string or up
to 4), ``seed``, ``n`` (1 only), ``stream`` and ``stream_options.include_usage``,
and vLLM's ``ignore_eos``; they travel as the request's parameters. Other fields are
accepted and ignored, as OpenAI's clients send many. ``stream: true`` answers
Server-Sent Events, a chunk per response of the model and ``data: [DONE]`` last; a
client that leaves cancels the generation, streamed or not. Errors have OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, with the status the data
plane's error maps to. Tokens and scopes are
those of inference (the front's middleware checks them before the body is read, and
its body limit applies); the model is admitted once the body named it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from appliance.adapters.access import Scope
from appliance.adapters.http import infer, limits, sse
from appliance.adapters.http.routing import Register
from appliance.config.model_config import ModelConfig
from appliance.core.dataplane import DataPlane
from appliance.core.servable import State
from appliance.errors import ApplianceError, Code, invalid, not_found
from appliance.request import InferenceRequest, InferenceResponse

OWNER = "appliance"
ERROR_TYPES = {Code.NOT_FOUND: "not_found_error", Code.UNAVAILABLE: "server_error"}
FINISH = {"stop": "stop", "length": "length"}
SAMPLING_DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error document (also the shape of the front's refusals on these routes:
    adapters/http/routing)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    elif status == 401:
        kind, code = "authentication_error", code or "invalid_api_key"
    elif status == 403:
        kind = "permission_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return orjson.dumps(body)


def _refusal_body(status: int, message: str) -> bytes:
    return error_body(status, message)


def _error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> web.Response:
    body = error_body(status, message, code, param)
    return web.Response(body=body, status=status, content_type=infer.JSON)


def _of(exc: ApplianceError) -> web.Response:
    code = "model_not_found" if exc.code is Code.NOT_FOUND else None
    return _error(infer.STATUS[exc.code], exc.message, code)


def takes_text(config: ModelConfig, chat: bool) -> bool:
    """Whether the model serves completions (or chat, ``chat``) here."""
    inputs = {t.name: t.datatype for t in config.inputs}
    outputs = {t.name: t.datatype for t in config.outputs}
    wanted = "messages" if chat else "text_input"
    return inputs.get(wanted) == "BYTES" and outputs.get("text_output") == "BYTES"


def _text_models(dataplane: DataPlane) -> list[dict[str, Any]]:
    rows = []
    for row in dataplane.repository_index(ready_only=True):
        try:
            config = dataplane.lifecycle.get(row["name"], "").config
        except ApplianceError:
            continue
        if takes_text(config, chat=False) or takes_text(config, chat=True):
            rows.append({"id": row["name"], "object": "model", "created": 0, "owned_by": OWNER})
    return sorted({r["id"]: r for r in rows}.values(), key=lambda r: r["id"])


# ---- the request ---------------------------------------------------------------------


def _number(doc: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = doc.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{key}' must be a number, got {value!r}")
    if kind is int and not isinstance(value, int):
        raise invalid(f"'{key}' must be an integer, got {value!r}")
    return kind(value)


def _stops(doc: dict[str, Any]) -> list[str]:
    stop = doc.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings")
    if len(stops) > 4:
        raise invalid(f"'stop' takes at most 4 strings, got {len(stops)}")
    return [s for s in stops if s]


def _content(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(f"messages[{index}] must be an object with a 'role' string")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # text parts: [{"type": "text", "text": ...}]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"messages[{index}]: only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{index}]: a text part needs a 'text' string")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"messages[{index}]: 'content' must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


def build(doc: dict[str, Any], config: ModelConfig, chat: bool) -> InferenceRequest:
    """The OpenAI request -> the model's inputs and the request's parameters."""
    n = doc.get("n", 1)
    if n not in (None, 1):
        raise invalid("only 'n': 1 is supported")
    if doc.get("echo"):
        raise invalid("'echo' is not supported")
    if doc.get("best_of") not in (None, 1):
        raise invalid("only 'best_of': 1 is supported")
    if chat:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a non-empty list")
        text = orjson.dumps([_content(m, i) for i, m in enumerate(messages)]).decode()
        name = "messages"
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise invalid("'prompt' must be a string (or a list of one string)")
        text, name = prompt, "text_input"
    inputs = {name: np.array([text.encode()], dtype=np.object_)}
    stops = _stops(doc)
    if stops:
        if "stop" not in {t.name for t in config.inputs}:
            raise invalid(f"model '{config.name}' takes no stop strings")
        inputs["stop"] = np.array([s.encode() for s in stops], dtype=np.object_)
    tokens_key = (
        "max_completion_tokens" if chat and "max_completion_tokens" in doc else "max_tokens"
    )
    params: dict[str, str | int | float | bool] = {
        "temperature": _number(doc, "temperature", float, SAMPLING_DEFAULTS["temperature"]),
        "top_p": _number(doc, "top_p", float, SAMPLING_DEFAULTS["top_p"]),
        "stream": bool(doc.get("stream")),
    }
    # completions default to OpenAI's 16 tokens; chat without a limit: the model's own
    tokens = _number(doc, tokens_key, int, None if chat else SAMPLING_DEFAULTS["max_tokens"])
    if tokens is not None:
        params["max_tokens"] = tokens
    if doc.get("seed") is not None:
        params["seed"] = _number(doc, "seed", int, 0)
    if doc.get("ignore_eos") is not None:  # vLLM's extension (extra_body in the client)
        if not isinstance(doc["ignore_eos"], bool):
            raise invalid("'ignore_eos' must be true or false")
        params["ignore_eos"] = doc["ignore_eos"]
    return InferenceRequest(config.name, inputs, "", parameters=params)


# ---- the answer ----------------------------------------------------------------------


def _scalar(response: InferenceResponse, name: str, default: Any) -> Any:
    arr = response.outputs.get(name)
    if arr is None or arr.size == 0:
        return default
    value = arr.reshape(-1)[0]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value.item()


class _Answer:
    """What the responses of one request add up to."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish = "stop"
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, response: InferenceResponse) -> str:
        """Take one response; its new text."""
        delta = str(_scalar(response, "text_output", ""))
        self.text.append(delta)
        finish = _scalar(response, "finish_reason", "")
        if finish:
            self.finish = FINISH.get(str(finish), "stop")
        self.prompt_tokens = int(_scalar(response, "num_input_tokens", self.prompt_tokens))
        self.completion_tokens = int(_scalar(response, "num_output_tokens", self.completion_tokens))
        return delta

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _choice(chat: bool, text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if not chat:
        choice["text"] = text or ""
    elif delta:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text or ""}
    return choice


def routes(key: web.AppKey[DataPlane], get: Register, post: Register) -> None:
    """Register ``/v1/models`` and the two completion routes (inference scope)."""

    async def models(request: web.Request) -> web.Response:
        data = _text_models(request.app[key])
        name = request.match_info.get("model")
        if name is None:
            return web.json_response({"object": "list", "data": data}, dumps=_dumps)
        found = [m for m in data if m["id"] == name]
        if not found:
            return _error(404, f"The model '{name}' does not exist", "model_not_found", "model")
        return web.json_response(found[0], dumps=_dumps)

    async def complete(request: web.Request, chat: bool) -> web.StreamResponse:
        dataplane = request.app[key]
        try:
            body = await limits.body(request)
            try:
                doc = orjson.loads(body or b"null")
            except orjson.JSONDecodeError as exc:
                raise invalid(f"malformed JSON in the request body: {exc}") from None
            if not isinstance(doc, dict):
                raise invalid("the request body must be a JSON object")
            model = doc.get("model")
            if not isinstance(model, str) or not model:
                raise invalid("'model' must name a model")
            if model not in {row["name"] for row in dataplane.repository_index()}:
                raise not_found(f"The model '{model}' does not exist")
            ticket = dataplane.admit(model, "", len(body))
        except ApplianceError as exc:
            return _of(exc)
        try:
            config = ticket.servable.config
            if ticket.servable.state is not State.READY or not takes_text(config, chat):
                what = "chat" if chat else "text completions"
                raise not_found(f"model '{model}' does not serve {what}")
            built = build(doc, config, chat)
            sse.declare(ticket, built.inputs)
            if built.parameters["stream"]:
                options = doc.get("stream_options") or {}
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await _stream(request, dataplane, built, ticket, chat, model, usage)
            # the model streams all the same: between its responses, a client that left
            # is seen, and its generation cancelled
            built.parameters["stream"] = True
            answer = _Answer()
            responses = sse.responses(dataplane, built, ticket)
            try:
                async for item in responses:
                    if isinstance(item, ApplianceError):
                        raise item
                    answer.add(item)
                    if sse.client_left(request):
                        raise ConnectionResetError("the client left")
            finally:
                await responses.aclose()
        except ApplianceError as exc:
            return _of(exc)
        finally:
            ticket.release()
        doc_out = _head(chat, model, chunk=False)
        doc_out["choices"] = [_choice(chat, "".join(answer.text), answer.finish, delta=False)]
        doc_out["usage"] = answer.usage()
        return web.Response(body=orjson.dumps(doc_out), content_type=infer.JSON)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await complete(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await complete(request, chat=True)

    shape = _refusal_body
    get("/v1/models", models, Scope.INFERENCE, shape)
    get("/v1/models/{model}", models, Scope.INFERENCE, shape)
    post("/v1/completions", completions, Scope.INFERENCE, shape)
    post("/v1/chat/completions", chat_completions, Scope.INFERENCE, shape)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _head(chat: bool, model: str, chunk: bool) -> dict[str, Any]:
    prefix = "chatcmpl" if chat else "cmpl"
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


async def _stream(
    request: web.Request,
    dataplane: DataPlane,
    built: InferenceRequest,
    ticket: Any,
    chat: bool,
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    """The responses as SSE chunks; an error after the first chunk goes as an error
    event (the status is sent already); ``[DONE]`` last."""
    head = _head(chat, model, chunk=True)
    answer = _Answer()
    response: web.StreamResponse | None = None
    items = sse.responses(dataplane, built, ticket)
    finished = False

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        assert response is not None
        await sse.event(response, orjson.dumps({**head, "choices": choices, **extra}))

    try:
        async for item in items:
            if isinstance(item, ApplianceError):
                if response is None:
                    return _of(item)
                error = {
                    "message": item.message,
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
                await sse.event(response, orjson.dumps({"error": error}))
                break
            if response is None:
                response = await sse.open_events(request)
                if chat:  # the assistant's role first, as OpenAI streams it
                    role = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    await send([role])
            delta = answer.add(item)
            if delta:
                await send([_choice(chat, delta, None, delta=True)])
            if _scalar(item, "finish_reason", "") and not finished:
                finished = True
                await send([_choice(chat, None if chat else "", answer.finish, delta=True)])
        if response is None:
            response = await sse.open_events(request)
        if not finished:  # a model without a finish_reason output: its stream ended
            await send([_choice(chat, None if chat else "", answer.finish, delta=True)])
        if include_usage:
            await send([], usage=answer.usage())
        await sse.event(response, b"[DONE]")
        await response.write_eof()
    except sse.GONE:
        pass  # the client left: closing the responses cancels the generation
    finally:
        await items.aclose()
    assert response is not None
    return response
