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
:mod:`appliance.adapters.codec.kserve`; a file becomes its input's data here, in that
form (no JSON rewritten and parsed again). :class:`MqttWire` is MQTT's reader and
encoder for the one exchange.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from appliance.adapters import exchange, request_form
from appliance.adapters.codec import kserve
from appliance.adapters.mqtt.protocol import Inbound, RequestTopic
from appliance.adapters.request_form import OutputFormat, RequestForm
from appliance.core.admission import Ticket
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError, Code, invalid
from appliance.request import InferenceRequest, InferenceResponse

HEADER_LENGTH = kserve.HEADER_LENGTH
FILE_PARAMETER = kserve.FILE_PARAMETER


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


def raw_form(payload: bytes, topic: RequestTopic, metadata: dict[str, Any]) -> RequestForm:
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
    fmt = OutputFormat(
        binary={o["name"]: o["datatype"] == "BYTES" for o in metadata.get("outputs", [])}
    )
    one = request_form.TensorForm(spec["name"], "BYTES", shape, request_form.OBJECT, payload)
    return RequestForm(model, topic.version, [one], fmt)


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


# the reply's payload, and the JSON header's length when binary outputs follow
Reply = tuple[bytes, int | None]


class MqttWire(exchange.Wire[Reply]):
    """MQTT's wire of the one exchange (:mod:`appliance.adapters.exchange`): a PUBLISH
    (``(message, topic)``) -> the form, with the HTTP reader for JSON and binary
    payloads (a ``file_path`` input read from ``file_root`` when the form is built, off
    the event loop) and a raw payload as its model's one BYTES element; an answer ->
    the reply's payload, in one join. The payload is the bridge's request: its
    ``msg`` and ``topic``, and ``proceed(request)``, its last look before inference."""

    text = joins = answers_once = True

    def __init__(self, file_root: Path | None, limit: int) -> None:
        self.file_root = file_root
        self.limit = limit

    def read(self, payload: Any, ticket: Ticket | None) -> RequestForm:
        msg, topic = payload.msg, payload.topic
        if payload_form(msg) == "raw":
            assert ticket is not None  # MQTT admits by its topic, before the payload
            return raw_form(msg.payload, topic, ticket.servable.metadata([]))
        header_length = kserve.parse_header_length(
            msg.user_property(HEADER_LENGTH), len(msg.payload)
        )
        model, version = topic.model, topic.version
        return kserve.parse_request(msg.payload, header_length, model, version, True)

    def proceed(self, payload: Any, request: InferenceRequest) -> bool:
        return bool(payload.proceed(request))

    def build(self, form: RequestForm, shm: SharedMemoryRegistry) -> InferenceRequest:
        read_files(form, self.file_root, self.limit)  # (the exchange runs it off the loop)
        return request_form.build(form, shm)

    def encode(self, response: InferenceResponse, fmt: OutputFormat, shm: Any) -> Reply:
        return kserve.encode_response(response, fmt, shm)
