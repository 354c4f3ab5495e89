"""MQTT payloads -> requests, through the one request form (no MQTT client in it).

Payload forms of a request (see docs/mqtt.md):

- **binary**: the message has the MQTT v5 user property
  ``Inference-Header-Content-Length``: a KServe JSON header followed by raw
  tensors, exactly Triton's binary extension over HTTP;
- **json**: content type ``application/json``, or a payload starting with ``{``;
- **raw**: anything else, taken whole as the single BYTES input of the model
  (a JPEG from a camera, say).

JSON and binary requests may name a registered shared-memory region
(``parameters.shared_memory_region``, as over HTTP) or a file on the device
(``parameters.file_path``, relative to ``mqtt.file_directory``) instead of
carrying a tensor. Both are read into the one request form by
:mod:`appliance.adapters.http_codec`; a file becomes its input's data here, in that
form (no JSON rewritten and parsed again).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np

from appliance.adapters import http_codec, offload, request_form
from appliance.adapters.mqtt_protocol import Inbound, RequestTopic
from appliance.adapters.request_form import OutputFormat, RequestForm
from appliance.core.admission import Ticket
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError, Code, invalid
from appliance.request import InferenceRequest

HEADER_LENGTH = http_codec.HEADER_LENGTH
FILE_PARAMETER = http_codec.FILE_PARAMETER


def payload_form(message: Inbound) -> str:
    """``binary``, ``json`` or ``raw`` (see the module docstring)."""
    if message.user_property(HEADER_LENGTH) is not None:
        return "binary"
    kind = message.content_type.split(";")[0].strip().lower()
    if kind == "application/json":
        return "json"
    if kind:
        return "raw"
    return "json" if message.payload.lstrip()[:1] == b"{" else "raw"


# ---- payload -> request ---------------------------------------------------------------


def raw_request(
    payload: bytes, topic: RequestTopic, metadata: dict[str, Any]
) -> tuple[InferenceRequest, OutputFormat]:
    """A raw payload as the only input of a single-BYTES-input model (one element).

    ``metadata`` is the model's KServe metadata. BYTES outputs are returned in the
    binary form (they may not be text); the others as JSON.
    """
    inputs = metadata.get("inputs", [])
    model = topic.model
    if len(inputs) != 1 or inputs[0]["datatype"] != "BYTES":
        described = ", ".join(f"{i['name']} ({i['datatype']})" for i in inputs)
        raise invalid(
            f"the payload is not a KServe v2 JSON request, and model '{model}' does not take "
            f"a raw payload (that needs exactly one BYTES input; its inputs are {described}); "
            f"send a JSON request or set the '{HEADER_LENGTH}' user property"
        )
    spec = inputs[0]
    shape = [1 if d == -1 else d for d in spec["shape"]]
    if int(np.prod(shape)) != 1:
        raise invalid(
            f"model '{model}': input '{spec['name']}' has shape {spec['shape']}; a raw payload "
            f"is one element"
        )
    array = np.empty(shape, dtype=object)
    array.reshape(-1)[0] = payload
    fmt = OutputFormat(
        binary={o["name"]: o["datatype"] == "BYTES" for o in metadata.get("outputs", [])}
    )
    return InferenceRequest(model, {spec["name"]: array}, topic.version), fmt


def read_device_file(root: Path | None, name: Any, limit: int, where: str) -> bytes:
    """The bytes of file ``name`` under ``root``; INVALID_ARG for anything outside it.

    ``name`` is relative to ``root`` (or absolute, inside it); the resolved path,
    symlinks followed, must stay inside ``root``, so ``..`` and links pointing out are
    refused. Blocking: call it off the event loop.
    """
    if root is None:
        raise invalid(f"{where}: file inputs are not enabled; set mqtt.file_directory")
    if not isinstance(name, str) or not name or "\0" in name:
        raise invalid(f"{where}: '{FILE_PARAMETER}' must be a non-empty path string")
    base = root.resolve()
    try:
        path = (base / name).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise invalid(f"{where}: file {name!r} does not exist under the file directory") from None
    if not path.is_relative_to(base):
        raise invalid(f"{where}: file {name!r} is outside the file directory; refused")
    if not path.is_file():  # checked before open(): opening a FIFO would block
        raise invalid(f"{where}: {name!r} is not a regular file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ApplianceError(
                    Code.TOO_LARGE, f"{where}: file {name!r} has {size} bytes, over {limit}"
                )
            return f.read(limit + 1)[:limit]
    except OSError as exc:
        raise invalid(f"{where}: cannot read file {name!r}: {exc.strerror}") from None


def read_files(form: RequestForm, root: Path | None, limit: int) -> None:
    """Read the inputs of ``form`` that name a file on the device (``file_path``) into
    their data: the file's bytes as raw tensor data, or for BYTES the whole file as
    one element. Blocking (reads files): off the event loop."""
    for t in form.inputs:
        if t.kind == request_form.FILE:
            data = read_device_file(root, t.data, limit, f"input '{t.name}'")
            t.kind = request_form.OBJECT if t.datatype == "BYTES" else request_form.RAW
            t.data = data


def decode(
    message: Inbound,
    topic: RequestTopic,
    shared_memory: SharedMemoryRegistry,
    file_root: Path | None,
    limit: int,
    ticket: Ticket | None = None,
) -> tuple[InferenceRequest, OutputFormat]:
    """A JSON or binary-extension payload -> request, through the one request form
    (:mod:`appliance.adapters.request_form`): parsed once, declared to the request's
    ``ticket`` (the model's limits) before any data is read, files read into it, then
    built. May block on file reads."""
    payload = message.payload
    header_length = http_codec.parse_header_length(
        message.user_property(HEADER_LENGTH), len(payload)
    )
    form = http_codec.parse_request(payload, header_length, topic.model, topic.version, True)
    request_form.declare(form, ticket, shared_memory)
    read_files(form, file_root, limit)
    return request_form.build(form, shared_memory), form.fmt


async def decode_payload(
    msg: Inbound,
    topic: RequestTopic,
    ticket: Ticket,
    shared_memory: SharedMemoryRegistry,
    file_root: Path | None,
    limit: int,
) -> tuple[InferenceRequest, OutputFormat]:
    """The payload -> request; the declarations are checked on the ticket before any
    data (or file) is read. Big payloads, many BYTES elements and file reads go to a
    worker thread (:mod:`appliance.adapters.offload`)."""
    if payload_form(msg) == "raw":
        return raw_request(msg.payload, topic, ticket.servable.metadata([]))
    if len(msg.payload) > offload.OFFLOAD_BYTES:
        return await asyncio.to_thread(decode, msg, topic, shared_memory, file_root, limit, ticket)
    header_length = http_codec.parse_header_length(
        msg.user_property(HEADER_LENGTH), len(msg.payload)
    )
    form = http_codec.parse_request(msg.payload, header_length, topic.model, topic.version, True)
    request_form.declare(form, ticket, shared_memory)
    if form.object_elements > offload.LOOP_OBJECTS or any(
        t.kind == request_form.FILE for t in form.inputs
    ):  # files are read from disk: never on the loop
        built = await asyncio.to_thread(_read_and_build, form, file_root, limit, shared_memory)
        return built, form.fmt
    return request_form.build(form, shared_memory), form.fmt


def _read_and_build(
    form: RequestForm, root: Path | None, limit: int, shm: SharedMemoryRegistry
) -> InferenceRequest:
    read_files(form, root, limit)
    return request_form.build(form, shm)
