"""KServe v2 / Triton gRPC tensor codec: ``ModelInferRequest`` <-> the data plane's types.

An input's data comes from exactly one place: a shared-memory region (its
``shared_memory_*`` parameters), the typed ``contents`` of the tensor, or the next
entry of ``raw_input_contents``. As in Triton, raw entries are taken in order by the
inputs that carry neither of the other two, there must be exactly one per such
input, and a request that uses ``raw_input_contents`` may not use ``contents``.
The message is read into the one request form (:mod:`appliance.adapters.request_form`,
which the HTTP codec fills too) and decoded from it.
Raw inputs become zero-copy views of the message bytes; outputs go back as
``raw_output_contents`` (what tritonclient reads) or into the caller's region.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from appliance import datatypes
from appliance.adapters import request_form
from appliance.adapters.request_form import OutputFormat, RequestForm, TensorForm
from appliance.core.admission import Ticket
from appliance.core.shared_memory import SharedMemoryRef, SharedMemoryRegistry
from appliance.errors import invalid
from appliance.request import (
    InferenceRequest,
    InferenceResponse,
    check_priority,
    check_sequence_id,
)

# KServe datatype -> the InferTensorContents field that carries it and that field's
# numpy type (narrower integer types travel widened, as in Triton's proto)
_CONTENTS: dict[str, tuple[str, np.dtype[Any]]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
    "BYTES": ("bytes_contents", np.dtype(object)),
}
_SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


def param(params: Any, key: str, kind: str, where: str) -> Any:
    """The value of one ``InferParameter`` (None when absent); INVALID_ARG when it is
    set through another field than ``kind`` (e.g. ``string_param``)."""
    if key not in params:  # indexing a protobuf map would insert the key
        return None
    got = params[key].WhichOneof("parameter_choice")
    if got != kind:
        raise invalid(f"{where}: parameter '{key}' must be set as {kind}, got {got or 'nothing'}")
    return getattr(params[key], kind)


def _shm_ref(params: Any, where: str) -> SharedMemoryRef | None:
    """The shared-memory parameters of a tensor, type-checked; None when absent."""
    region = param(params, "shared_memory_region", "string_param", where)
    if region is None:
        if any(k in params for k in _SHM_KEYS):
            raise invalid(f"{where}: shared-memory parameters without 'shared_memory_region'")
        return None
    if not region:
        raise invalid(f"{where}: 'shared_memory_region' must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise invalid(f"{where}: shared-memory tensors need 'shared_memory_byte_size'")
    sizes = []
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        value = param(params, key, "int64_param", where) or 0
        if value < 0:
            raise invalid(f"{where}: '{key}' must be a non-negative integer, got {value}")
        sizes.append(int(value))
    return SharedMemoryRef(region, *sizes)


def _from_contents(contents: Any, datatype: str, shape: list[int], name: str) -> np.ndarray:
    where = f"input '{name}'"
    if datatype not in _CONTENTS:
        raise invalid(f"{where}: {datatype} has no 'contents' field; send it in raw_input_contents")
    field, wide = _CONTENTS[datatype]
    for descriptor, _ in contents.ListFields():
        if descriptor.name != field:
            raise invalid(
                f"{where}: {datatype} data belongs in contents.{field}, "
                f"got contents.{descriptor.name}"
            )
    values = getattr(contents, field)
    count = datatypes.element_count(shape)
    if len(values) != count:
        raise invalid(
            f"{where}: contents.{field} has {len(values)} elements but shape {shape} needs {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr.reshape(shape)
    arr = np.fromiter(values, dtype=wide, count=count)
    target = datatypes.to_numpy_dtype(datatype)
    if target != wide:  # INT8/16, UINT8/16 arrive widened: refuse values that don't fit
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise invalid(
                f"{where}: contents.{field} has a value outside the {datatype} range "
                f"[{info.min}, {info.max}]"
            )
        arr = arr.astype(target)
    return arr.reshape(shape)


def decode_request(
    msg: Any, shm: SharedMemoryRegistry | None, ticket: Ticket | None = None
) -> tuple[InferenceRequest, dict[str, SharedMemoryRef]]:
    """``ModelInferRequest`` -> (request, outputs to write into shared memory):
    :func:`parse_request`, then the one declare and build of
    :mod:`appliance.adapters.request_form`."""
    form = parse_request(msg)
    request_form.declare(form, ticket, shm)
    return request_form.build(form, shm), form.fmt.shared_memory


def parse_request(msg: Any, raw: Sequence[Any] | None = None) -> RequestForm:
    """Read a ``ModelInferRequest`` into the request form, decoding no tensor. Every
    malformed part is an INVALID_ARG naming the tensor. ``raw``: the message's
    ``raw_input_contents`` as views of the wire bytes (:func:`raw_contents`), when
    the caller has them (reading the message's own entries copies each)."""
    if raw is None:  # no inputs at all: a model whose inputs are all optional
        raw = msg.raw_input_contents
    takes_raw = 0
    for tensor in msg.inputs:
        if tensor.HasField("contents"):
            if raw:  # Triton's words
                raise invalid(
                    "contents field must not be specified when using raw_input_contents "
                    f"for '{tensor.name}' for model '{msg.model_name}'"
                )
        elif "shared_memory_region" not in tensor.parameters:
            takes_raw += 1
    if raw and len(raw) != takes_raw:
        names = [
            t.name
            for t in msg.inputs
            if not t.HasField("contents") and "shared_memory_region" not in t.parameters
        ]
        raise invalid(
            f"the request has {len(raw)} raw_input_contents but {takes_raw} input(s) "
            f"take raw data {names}: there must be exactly one per input, in order"
        )
    inputs: list[TensorForm] = []
    next_raw = 0
    for tensor in msg.inputs:
        name = tensor.name
        where = f"input '{name}'"
        if not name:
            raise invalid("every input needs a name")
        ref = _shm_ref(tensor.parameters, where) if tensor.parameters else None
        if ref is not None:
            if tensor.HasField("contents"):
                raise invalid(f"{where} has both 'contents' and shared-memory parameters")
            kind, data = request_form.SHM, ref
        elif tensor.HasField("contents"):
            kind, data = request_form.CONTENTS, tensor.contents
        elif raw:
            kind, data = request_form.RAW, raw[next_raw]
            next_raw += 1
        else:
            raise invalid(
                f"{where} has no data: send it in raw_input_contents, 'contents' or shared memory"
            )
        inputs.append(TensorForm(name, tensor.datatype, list(tensor.shape), kind, data))
    outputs: list[str] = []
    classification: dict[str, int] = {}
    fmt = OutputFormat()
    for tensor in msg.outputs:
        name = tensor.name
        where = f"output '{name}'"
        if name in outputs:  # Triton's words
            raise invalid(f"output '{name}' already exists in request")
        if not name:
            raise invalid("a requested output needs a name")
        if tensor.parameters:
            count = param(tensor.parameters, "classification", "int64_param", where) or 0
            if count < 0:
                raise invalid(f"{where}: 'classification' must be a non-negative integer")
            if count:
                classification[name] = int(count)
            ref = _shm_ref(tensor.parameters, where)
            if ref is not None:
                if count:
                    raise invalid(f"{where}: a classification output cannot go to shared memory")
                fmt.shared_memory[name] = ref
        outputs.append(name)
    form = RequestForm(
        msg.model_name, msg.model_version, inputs, fmt, tuple(outputs), classification, msg.id
    )
    form.contents = _from_contents
    if msg.parameters:
        _request_parameters(msg.parameters, form)
    return form


def _request_parameters(params: Any, form: RequestForm) -> None:
    timeout = param(params, "timeout", "int64_param", "request")
    if timeout is not None and timeout < 0:
        raise invalid("request parameter 'timeout' must be a non-negative integer (microseconds)")
    form.timeout_us = int(timeout) if timeout else None
    sequence: object = 0
    if "sequence_id" in params:  # tritonclient sends int64, others uint64 or string
        kind = params["sequence_id"].WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param", "string_param"):
            raise invalid("request parameter 'sequence_id' must be an integer or a string")
        sequence = getattr(params["sequence_id"], kind)
    form.sequence_id = check_sequence_id(sequence)
    form.sequence_start = bool(param(params, "sequence_start", "bool_param", "request"))
    form.sequence_end = bool(param(params, "sequence_end", "bool_param", "request"))
    form.parameters = request_form.own_parameters(params)
    if "priority" in params:  # tritonclient sends uint64, others int64
        kind = params["priority"].WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise invalid("request parameter 'priority' must be an unsigned integer")
        form.priority = check_priority(getattr(params["priority"], kind))


def encode_response(
    response: InferenceResponse,
    shm_outputs: dict[str, SharedMemoryRef],
    shm: SharedMemoryRegistry,
) -> Any:
    """Response -> ``ModelInferResponse``, byte for byte as Triton writes it.

    There is one ``raw_output_contents`` entry per output, in output order (clients,
    perf_analyzer among them, index them by the output's position); an output
    written to its shared-memory region has an empty entry and no parameters.
    """
    msg = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    raws: list[bytes] = []
    for name, arr in response.outputs.items():
        msg.outputs.add(name=name, datatype=datatypes.from_numpy_dtype(arr.dtype), shape=arr.shape)
        data = datatypes.to_raw(arr)
        ref = shm_outputs.get(name)
        if ref is None:
            raws.append(bytes(data))  # protobuf takes bytes only: the one copy
        else:
            shm.write(ref.region, ref.offset, ref.byte_size, data, f"output '{name}'")
            raws.append(b"")
    msg.raw_output_contents.extend(raws)
    return msg
