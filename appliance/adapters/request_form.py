"""The one request form under every wire, and the one decode from it.

Each codec reads its wire into a :class:`RequestForm` (HTTP and MQTT: the KServe JSON
document and its binary tail, :mod:`appliance.adapters.codec.kserve`; gRPC: the
``ModelInferRequest``, :mod:`appliance.adapters.grpc.codec`): every input's name,
datatype, shape and where its data is (:class:`TensorForm`), the outputs asked for and
how, and the request parameters, all type-checked, no tensor data touched. Then, the
same for every wire:

1. :func:`declare`: each input's declaration is checked (a name given once, a known
   datatype, a well-formed shape) and declared to the request's
   :class:`~appliance.core.admission.Ticket` (the server's element limit and the
   model's rules), before any data is decoded; output windows in shared memory are
   bounds-checked before the model runs;
2. :func:`build`: the tensors are decoded to exactly their declarations: zero-copy
   views of the wire buffer for raw data and of the region for shared memory.

An adapter runs :func:`build` off the event loop when the form holds many BYTES
elements (``RequestForm.object_elements``) or the payload is big (see
:mod:`appliance.adapters.offload`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance import datatypes
from appliance.adapters.codec import json_tensors
from appliance.core.admission import Ticket
from appliance.core.shared_memory import SharedMemoryRef, SharedMemoryRegistry
from appliance.errors import internal, invalid
from appliance.request import InferenceRequest

# where an input's data is (TensorForm.kind)
RAW = "raw"  # bytes-like, little-endian (Triton's length-prefixed form for BYTES)
JSON = "json"  # a JSON ``data`` list, or json_tensors.LazyData
CONTENTS = "contents"  # gRPC typed contents, decoded by the form's ``contents`` reader
SHM = "shm"  # a SharedMemoryRef into a registered region
OBJECT = "object"  # one BYTES element given whole (an MQTT file's bytes)
FILE = "file"  # a file on the device, by name (MQTT): read into RAW/OBJECT before build()
ARRAY = "array"  # a numpy array already (the in-process API): passed by reference


# request parameters the server reads itself; the others travel with the request (to
# a decoupled model: a language model's sampling settings)
SERVER_PARAMETERS = frozenset(
    (
        "binary_data_output",
        "timeout",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "headers",
        "triton_enable_empty_final_response",
    )
)
# the kinds a custom parameter may have (Triton refuses uint64_param there)
_SCALARS = ("bool_param", "int64_param", "double_param", "string_param")


# the one ``triton_`` key a gRPC request may carry (Triton's list)
GRPC_TRITON_PARAMETERS = ("triton_enable_empty_final_response",)


def own_parameters(params: Any) -> dict[str, str | int | float | bool]:
    """A gRPC request's parameters that are not the server's, as plain values (the
    model's ``request.parameters()``); a ``triton_`` key other than Triton's own is
    refused with Triton's text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in params.items():
        if key.startswith("triton_") and key not in GRPC_TRITON_PARAMETERS:
            raise invalid(
                "parameter keys starting with 'triton_' are reserved for Triton usage. "
                "Only the following keys starting with 'triton_' are allowed: "
                + " ".join(GRPC_TRITON_PARAMETERS)
            )
        kind = value.WhichOneof("parameter_choice")
        if key in SERVER_PARAMETERS:
            continue
        if kind not in _SCALARS:
            raise invalid(
                f"invalid value type for '{key}' parameter, expected int64_param, "
                "bool_param, or string_param."
            )
        out[key] = getattr(value, kind)
    return out


def json_parameters(params: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """A KServe JSON request's parameters that are not the server's (the model's
    ``request.parameters()``): strings, numbers and booleans, as Triton takes them; a
    ``triton_`` key or another type is refused with Triton's text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in params.items():
        if key.startswith("triton_"):
            raise invalid(
                "parameter keys starting with 'triton_' are reserved for Triton usage "
                "and should not be specified."
            )
        if key in SERVER_PARAMETERS:
            continue
        if not isinstance(value, (str, int, float, bool)):
            raise invalid(
                f"parameter '{key}' has invalid type. It should be either 'int', 'bool', "
                "or 'string'."
            )
        out[key] = value
    return out


# the name of the one input of Triton's raw binary request (HTTP with an
# Inference-Header-Content-Length of 0): declare() names it from the model's config
RAW_INPUT = "raw_input"


@dataclass(slots=True)
class TensorForm:
    """One input as a wire declares it; ``data`` as :data:`RAW` .. :data:`OBJECT` say."""

    name: str
    datatype: str
    shape: Any  # as sent: declare() checks it and leaves a list of ints
    kind: str
    data: Any
    parameters: dict[str, Any] = field(default_factory=dict)  # wire-specific extras


@dataclass(slots=True)
class OutputFormat:
    """How the caller wants outputs encoded: per-output binary flags and the default
    (HTTP and MQTT), and the outputs to write into shared memory instead."""

    binary: dict[str, bool] = field(default_factory=dict)
    binary_default: bool = False
    shared_memory: dict[str, SharedMemoryRef] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


@dataclass(slots=True)
class RequestForm:
    """A request as read off its wire, before any tensor is decoded."""

    model: str
    version: str
    inputs: list[TensorForm]
    fmt: OutputFormat
    outputs: tuple[str, ...] = ()
    classification: dict[str, int] = field(default_factory=dict)
    id: str = ""
    timeout_us: int | None = None
    sequence_id: int | str = 0
    sequence_start: bool = False
    sequence_end: bool = False
    # the request's own parameters that are not the server's: to a decoupled model
    parameters: dict[str, str | int | float | bool] = field(default_factory=dict)
    priority: int = 0
    # typed contents -> array (gRPC's InferTensorContents reader)
    contents: Callable[[Any, str, list[int], str], np.ndarray] | None = None
    # BYTES elements build() turns into Python objects, one each (not JSON ones: the
    # JSON parser made those objects already)
    object_elements: int = 0
    files: int = 0  # inputs that name a file on the device (read when built: blocking)


def declare(
    form: RequestForm, ticket: Ticket | None, shared_memory: SharedMemoryRegistry | None
) -> None:
    """Check every declaration of ``form`` (see the module docstring) and declare each
    input to ``ticket`` (None: the sizes and forms only, as in the codec tests)."""
    seen: set[str] = set()
    objects = files = 0
    if form.inputs and form.inputs[0].name == RAW_INPUT and not form.inputs[0].datatype:
        _raw_input(form.inputs[0], ticket)
    for t in form.inputs:
        if t.name in seen:
            raise invalid(f"input '{t.name}' appears twice")
        seen.add(t.name)
        if t.datatype not in datatypes.KNOWN:
            datatypes.to_numpy_dtype(t.datatype)  # unknown datatype -> INVALID_ARG
        count = datatypes.plain_count(t.shape)
        if count is None:  # refused here, with the reason
            t.shape = datatypes.check_shape(t.shape, f"input '{t.name}'")
        if ticket is not None:
            ticket.declare(t.name, t.datatype, t.shape, count)
        if t.kind == SHM:
            where = f"input '{t.name}'"
            if shared_memory is None:
                raise invalid(f"{where}: shared-memory inputs are not enabled on this server")
            _hold(shared_memory, t.data.region, ticket, where)
        if t.datatype == "BYTES" and t.kind in (RAW, SHM):
            objects += datatypes.element_count(t.shape)
        elif t.kind == FILE:
            files += 1
    for name, ref in form.fmt.shared_memory.items():
        where = f"output '{name}'"
        if shared_memory is None:
            raise invalid(f"{where}: shared-memory outputs are not enabled on this server")
        _hold(shared_memory, ref.region, ticket, where)
        shared_memory.check(ref.region, ref.offset, ref.byte_size, where)  # before the model runs
    form.object_elements, form.files = objects, files
    if ticket is not None:
        ticket.declared = True


def _hold(
    shared_memory: SharedMemoryRegistry, name: str, ticket: Ticket | None, where: str
) -> None:
    """Keep region ``name`` registered until the request is answered (Triton's: an
    unregister meanwhile waits for it)."""
    if ticket is not None:
        region = shared_memory.hold(name, where)
        ticket.on_release(lambda: shared_memory.release(region))


def build(form: RequestForm, shared_memory: SharedMemoryRegistry | None) -> InferenceRequest:
    """Decode the tensors of a declared form: zero-copy views for fixed-size raw and
    shared-memory data; INVALID_ARG for data that does not match its declaration."""
    inputs: dict[str, np.ndarray] = {}
    for t in form.inputs:
        kind, data = t.kind, t.data
        if kind == RAW:
            arr = datatypes.from_raw(data, t.datatype, t.shape, t.name, form.model)
        elif kind == JSON:
            if isinstance(data, json_tensors.LazyData):  # simdjson: no object a number
                arr = data.to_tensor(t.datatype, t.shape, t.name)
            else:
                arr = datatypes.from_json_data(data, t.datatype, t.shape, t.name)
        elif kind == SHM:
            assert shared_memory is not None  # declare() refused it otherwise
            where = f"input '{t.name}'"
            view = shared_memory.view(data.region, data.offset, data.byte_size, where)
            arr = datatypes.from_raw(view, t.datatype, t.shape, t.name, form.model)
        elif kind == CONTENTS:
            assert form.contents is not None
            arr = form.contents(data, t.datatype, t.shape, t.name)
        elif kind == OBJECT:
            arr = _one_element(data, t)
        elif kind == ARRAY:  # its datatype and shape are the array's own
            arr = data
        else:
            raise internal(f"input '{t.name}': its {kind} data was not read before decoding")
        inputs[t.name] = arr
    return InferenceRequest(
        model_name=form.model,
        inputs=inputs,
        model_version=form.version,
        outputs=form.outputs,
        id=form.id,
        timeout_us=form.timeout_us,
        classification=form.classification,
        sequence_id=form.sequence_id,
        sequence_start=form.sequence_start,
        sequence_end=form.sequence_end,
        parameters=form.parameters,
        priority=form.priority,
    )


def _one_element(data: bytes, t: TensorForm) -> np.ndarray:
    count = datatypes.element_count(t.shape)
    if count != 1:
        raise invalid(
            f"input '{t.name}': its data is one BYTES element but shape {t.shape} needs {count}"
        )
    arr = np.empty(1, dtype=object)
    arr[0] = data
    shaped: np.ndarray = arr.reshape(t.shape)
    return shaped


def _raw_input(t: TensorForm, ticket: Ticket | None) -> None:
    """Name and shape the input of a raw binary request from the model's config, as
    Triton deduces them (its texts): the model's one input, a batch of 1 where the
    model batches, one variable dim sized by the body; BYTES: one element, the body."""
    if ticket is None:
        raise invalid("a raw binary request needs the model's config to name its input")
    config = ticket.rules.config
    if len(config.inputs) != 1:
        raise invalid(
            "Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.inputs)} inputs in '{config.name}' model configuration"
        )
    spec = config.inputs[0]
    shape = [1] if config.batch_size > 0 else []
    dynamic, count = -1, 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic != -1:
                raise invalid(
                    f"The shape of the raw input '{spec.name}' can not be deduced because "
                    "there are more than one variable-sized dimension"
                )
            dynamic = len(shape)
        else:
            count *= dim
        shape.append(dim)
    t.name, t.datatype = spec.name, spec.datatype
    if spec.datatype == "BYTES":
        if dynamic != -1 or count != 1:
            raise invalid(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        t.kind, t.data = OBJECT, bytes(t.data)
    elif dynamic != -1:
        shape[dynamic] = (
            len(t.data) // max(count, 1) // datatypes.to_numpy_dtype(spec.datatype).itemsize
        )
    t.shape = shape
