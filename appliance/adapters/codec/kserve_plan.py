"""The plain KServe request of one model version, read in one pass.

Most requests a device serves look alike: every input of the model, once, in binary
(Triton's binary tensor extension: a name, a datatype, a shape and a
``binary_data_size``), the outputs asked for by name, binary or not, and nothing
else. :class:`Plan` resolves once, per model version, what such a request must
declare (each input's datatype, numpy dtype and dims with the batch dimension), and
:meth:`Plan.read` reads a body of that form straight into the request: the JSON
header parsed once, each input checked against its declaration and viewed in the
body (no copy), the request's elements counted against the server's limit and
declared to its :class:`~appliance.core.admission.Ticket` at once.
:meth:`Plan.read_message` does the same for gRPC's ``ModelInferRequest`` once
protobuf has parsed it (every input in ``raw_input_contents``, no parameters): there
the request names its model, so the plan reads it before the ticket is taken, and the
exchange declares its elements to the ticket it admits.

It decides nothing on its own: a body it does not recognise in every detail
(parameters, shared memory, JSON data, an unknown or repeated name, another shape,
a size that does not add up, an input missing) gets ``None``, and the exchange reads
it the general way (:mod:`appliance.adapters.codec.kserve`,
:mod:`appliance.adapters.request_form`), which accepts it or refuses it with the
precise error. So the plan is a fast case of the one exchange, never a second set of
rules: ``tests/adapters/test_kserve_plan.py`` (and ``test_kserve_plan_grpc.py`` for
the messages) checks, on valid bodies and on hostile ones, that whatever the plan
accepts the general reader decodes to the same request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from appliance import datatypes
from appliance.adapters.request_form import OutputFormat
from appliance.core.admission import Ticket
from appliance.core.servable import Servable
from appliance.request import InferenceRequest

# a gRPC request parameter the unary call ignores (a stream's)
_EMPTY_FINAL = "triton_enable_empty_final_response"

# the keys of a plain request's parts: anything else is the general reader's
_INPUT_KEYS = frozenset(("name", "datatype", "shape", "parameters"))
_DOC_KEYS = frozenset(("inputs", "outputs", "id"))


class _Input:
    __slots__ = ("datatype", "dims", "dtype", "itemsize")

    def __init__(self, datatype: str, dims: tuple[int, ...]) -> None:
        self.datatype = datatype
        self.dims = dims  # the batch dimension first (-1) where the model batches
        self.dtype = datatypes.to_numpy_dtype(datatype).newbyteorder("<")
        self.itemsize = self.dtype.itemsize


class Plan:
    """What a plain request of one model version declares, resolved at its first
    request (:func:`plan_of`)."""

    __slots__ = ("__weakref__", "batch", "inputs", "outputs")

    def __init__(self, servable: Servable) -> None:
        config = servable.config
        self.batch = config.max_batch_size or 0
        lead = (-1,) if self.batch > 0 else ()
        self.inputs = {t.name: _Input(t.datatype, lead + tuple(t.dims)) for t in config.inputs}
        self.outputs = frozenset(t.name for t in config.outputs)

    @staticmethod
    def applies(servable: Servable) -> bool:
        """Whether a plain request means the same to this version as the general
        reader's: fixed-size inputs (BYTES ones are parsed element by element), none
        optional (a plain request gives them all), at least one."""
        inputs = servable.config.inputs
        return bool(inputs) and all(
            t.datatype != "BYTES" and not t.optional and t.reshape is None for t in inputs
        )

    def read(
        self, body: bytes | bytearray, header_length: int, ticket: Ticket, model: str, version: str
    ) -> tuple[InferenceRequest, OutputFormat] | None:
        """The request in ``body`` (its JSON header ``header_length`` bytes long) for
        ``model`` and ``version`` as the caller named them, its inputs declared to
        ``ticket``; None when the body is not plain (the general reader's then)."""
        if not 0 < header_length <= len(body):
            return None
        try:
            doc = orjson.loads(memoryview(body)[:header_length])
        except orjson.JSONDecodeError:
            return None
        if type(doc) is not dict or not _DOC_KEYS.issuperset(doc):
            return None
        raw_inputs = doc.get("inputs")
        specs = self.inputs
        if type(raw_inputs) is not list or len(raw_inputs) != len(specs):
            return None
        arrays: dict[str, np.ndarray] = {}
        offset, elements, rows = header_length, 0, -1
        for raw in raw_inputs:
            if type(raw) is not dict or raw.keys() != _INPUT_KEYS:
                return None
            name = raw["name"]
            spec = specs.get(name) if type(name) is str else None
            if spec is None or name in arrays or raw["datatype"] != spec.datatype:
                return None
            params = raw["parameters"]
            if type(params) is not dict or len(params) != 1:
                return None
            size: Any = params.get("binary_data_size")  # an int once counted
            shape = raw["shape"]
            count = self._count(spec, shape, size, rows)
            if count < 0 or offset + size > len(body):
                return None
            if self.batch > 0:
                rows = shape[0]
            arrays[name] = np.frombuffer(body, spec.dtype, count, offset).reshape(shape)
            offset += size
            elements += count
        if offset != len(body) or elements > ticket.max_elements:
            return None
        fmt = OutputFormat()
        outputs = _outputs(doc.get("outputs"), self.outputs, fmt)
        request_id = doc.get("id", "")
        if outputs is None or type(request_id) is not str:
            return None
        ticket.planned(elements)
        return InferenceRequest(model, arrays, version, outputs, request_id), fmt

    def read_message(
        self, msg: Any, max_elements: int
    ) -> tuple[InferenceRequest, OutputFormat, int] | None:
        """The request in ``msg``, a ``ModelInferRequest`` protobuf parsed (gRPC), when
        it is plain: every input of the version once, its data the next entry of
        ``raw_input_contents``, no parameters on any tensor nor on the request (but
        Triton's ``triton_enable_empty_final_response``, which perf_analyzer and
        Triton's clients send, and which asks a stream, not one call), the outputs
        asked for by name; its elements within ``max_elements``. (request, format,
        elements), to be declared to the ticket admitted for it
        (:meth:`~appliance.core.admission.Ticket.planned`), or None (the general
        reader's then)."""
        specs = self.inputs
        tensors, contents = msg.inputs, msg.raw_input_contents
        if len(tensors) != len(specs) or len(contents) != len(specs):
            return None
        params = msg.parameters
        if params and (len(params) != 1 or _EMPTY_FINAL not in params):
            return None  # (that one asks a stream for an empty final response: not ours)
        arrays: dict[str, np.ndarray] = {}
        elements, rows = 0, -1
        for tensor, data in zip(tensors, contents):  # noqa: B905 (lengths checked)
            name = tensor.name
            spec = specs.get(name)
            if spec is None or name in arrays or tensor.datatype != spec.datatype:
                return None
            if tensor.parameters or tensor.HasField("contents"):
                return None
            shape = list(tensor.shape)
            count = self._count(spec, shape, len(data), rows)
            if count < 0:
                return None
            if self.batch > 0:
                rows = shape[0]
            arrays[name] = np.frombuffer(data, spec.dtype, count).reshape(shape)
            elements += count
        if elements > max_elements:
            return None
        outputs: list[str] = []
        for tensor in msg.outputs:
            name = tensor.name
            if name not in self.outputs or name in outputs or tensor.parameters:
                return None
            outputs.append(name)
        request = InferenceRequest(
            msg.model_name, arrays, msg.model_version, tuple(outputs), msg.id
        )
        return request, OutputFormat(), elements

    def _count(self, spec: _Input, shape: Any, size: Any, rows: int) -> int:
        """The element count of one input of ``shape`` and ``size`` bytes when it is
        declared as ``spec`` says (rank, fixed dims, datatype's size) with the batch
        size of the request's other inputs (``rows``; -1 before the first) within the
        version's maximum; -1 when it is not."""
        count = datatypes.plain_count(shape)
        if count is None or type(size) is not int or not datatypes.fits(spec.dims, shape):
            return -1
        if count * spec.itemsize != size:
            return -1
        if self.batch > 0:
            first = shape[0]
            if not 1 <= first <= self.batch or (rows != -1 and first != rows):
                return -1
        return count


def _outputs(raw: Any, names: frozenset[str], fmt: OutputFormat) -> tuple[str, ...] | None:
    """The outputs asked for, by name, binary or not (into ``fmt``); None when the list
    is not plain."""
    if raw is None:
        return ()
    if type(raw) is not list:
        return None
    for entry in raw:
        if type(entry) is not dict:
            return None
        name = entry.get("name")
        if type(name) is not str or name not in names or name in fmt.binary:
            return None
        if len(entry) == 1:
            fmt.binary[name] = False
            continue
        params = entry.get("parameters")
        if len(entry) != 2 or type(params) is not dict or len(params) != 1:
            return None
        binary = params.get("binary_data")
        if type(binary) is not bool:
            return None
        fmt.binary[name] = binary
    return tuple(fmt.binary)


_plans: weakref.WeakKeyDictionary[Servable, Plan | None] = weakref.WeakKeyDictionary()


def plan_of(servable: Servable) -> Plan | None:
    """The plan of ``servable`` (made at its first request), or None when a plain
    request means something else to it (:meth:`Plan.applies`)."""
    try:
        return _plans[servable]
    except KeyError:
        plan = Plan(servable) if Plan.applies(servable) else None
        _plans[servable] = plan
        return plan


def plan_message(
    msg: Any, serving: Callable[[str, str], Servable | None], max_elements: int
) -> tuple[Servable, InferenceRequest, OutputFormat, int] | None:
    """A parsed ``ModelInferRequest`` read by the plan of the version it names (looked
    up with ``serving``): (that version, request, format, elements), or None (the
    general reader's then). Both gRPC calls plan with it, one call and a stream."""
    servable = serving(msg.model_name, msg.model_version)
    if servable is None:
        return None
    plan = plan_of(servable)
    if plan is None:
        return None
    read = plan.read_message(msg, max_elements)
    return None if read is None else (servable, *read)
