"""The plain-request plan on gRPC's ``ModelInferRequest`` against the general gRPC
reader, its oracle: whatever message the plan reads, the general reader (parse,
declare, build, the whole-request rules) decodes to the same request, with the same
element count; what the general reader refuses, the plan leaves to it (None)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_kserve_plan import (
    BATCHED,
    FIXED,
    MAX_ELEMENTS,
    WIDE,
    _ticket,
    _Version,
    assert_same_request,
    read_and_declined,
)

from appliance.adapters import request_form
from appliance.adapters.codec.kserve_plan import plan_of
from appliance.errors import ApplianceError

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
codec = pytest.importorskip("appliance.adapters.grpc.codec")


def _plain(rows: int = 2, cols: int = 3) -> Any:
    msg = service_pb2.ModelInferRequest(model_name="m", model_version="7")
    a = msg.inputs.add(name="A", datatype="INT32")
    a.shape.extend([rows, 4])
    b = msg.inputs.add(name="B", datatype="FP32")
    b.shape.extend([rows, cols, 2])
    msg.raw_input_contents.append(np.arange(rows * 4, dtype="<i4").tobytes())
    msg.raw_input_contents.append(np.linspace(0, 1, rows * cols * 2, dtype="<f4").tobytes())
    msg.outputs.add(name="S")
    msg.outputs.add(name="T")
    return msg


def _compare(version: _Version, msg: Any) -> bool:
    """Both readers on one message: the plan's request equals the general one's whenever
    the plan reads it, and the plan reads nothing the general reader refuses. True
    when the plan read it."""

    async def both() -> bool:
        plan = plan_of(version)  # type: ignore[arg-type]
        assert plan is not None
        quick = plan.read_message(msg, MAX_ELEMENTS)
        ticket = _ticket(version)
        try:
            form = codec.parse_request(msg)
            request_form.declare(form, ticket, None)
            general = request_form.build(form, None)
            version.rules.check(general, ticket.trusts(version))  # type: ignore[arg-type]
        except ApplianceError:
            assert quick is None, "the plan read a message the general reader refuses"
            return False
        if quick is None:
            return False
        request, fmt, elements = quick
        assert elements == ticket.elements
        assert (fmt.binary, fmt.shared_memory) == (form.fmt.binary, form.fmt.shared_memory)
        assert_same_request(request, general)
        return True

    return asyncio.run(both())


def test_a_plain_message_reads_as_the_general_reader_reads_it() -> None:
    for rows, cols in ((1, 1), (2, 3), (8, 5)):
        assert _compare(BATCHED, _plain(rows, cols))
    msg = _plain()  # as perf_analyzer and Triton's clients send it
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    assert _compare(BATCHED, msg)
    msg = _plain()
    del msg.outputs[:]
    msg.id = "request-7"
    assert _compare(BATCHED, msg)
    msg = _plain()
    msg.inputs[0].name, msg.inputs[1].name = "B", "A"  # in another order: names decide
    msg.inputs[0].datatype, msg.inputs[1].datatype = "FP32", "INT32"
    shapes = list(msg.inputs[0].shape), list(msg.inputs[1].shape)
    msg.inputs[0].ClearField("shape")
    msg.inputs[0].shape.extend(shapes[1])
    msg.inputs[1].ClearField("shape")
    msg.inputs[1].shape.extend(shapes[0])
    msg.raw_input_contents.reverse()
    assert _compare(BATCHED, msg)
    fixed = service_pb2.ModelInferRequest(model_name="m", model_version="7")
    x = fixed.inputs.add(name="X", datatype="FP64")
    x.shape.append(3)
    fixed.raw_input_contents.append(np.array([1.5, -2.0, 3.25], dtype="<f8").tobytes())
    assert _compare(FIXED, fixed)


def _mutations() -> list[Any]:
    """Messages one change away from a plain one: each is refused by the general reader,
    means something the plan leaves to it, or is still plain."""
    out: list[Any] = []

    def add(change: Callable[[Any], Any]) -> None:
        msg = _plain()
        change(msg)
        out.append(msg)

    for i in (0, 1):
        for name in ("", "Z", "AB", "a", "B" if i == 0 else "A"):
            add(lambda m, i=i, name=name: setattr(m.inputs[i], "name", name))
        for datatype in ("", "INT64", "FP16", "BYTES", "int32", "FP32", "INT32"):
            add(lambda m, i=i, d=datatype: setattr(m.inputs[i], "datatype", d))
        for dim in range(3 if i else 2):
            for value in (0, 1, 3, 9, -1, 2**40):
                add(lambda m, i=i, d=dim, v=value: m.inputs[i].shape.__setitem__(d, v))
            add(lambda m, i=i, d=dim: m.inputs[i].shape.__delitem__(d))
        add(lambda m, i=i: m.inputs[i].shape.append(1))
        add(lambda m, i=i: m.inputs[i].ClearField("shape"))
        add(lambda m, i=i: m.inputs[i].parameters["binary_data_size"].int64_param)
        add(lambda m, i=i: setattr(m.inputs[i].parameters["binary_data_size"], "int64_param", 32))
        add(lambda m, i=i: setattr(m.inputs[i].parameters["shared_memory_region"],
                                   "string_param", "r"))  # fmt: skip
        add(lambda m, i=i: m.inputs[i].contents.int_contents.extend([1] * 8))
        add(lambda m, i=i: m.raw_input_contents.__setitem__(i, m.raw_input_contents[i][:-1]))
        add(lambda m, i=i: m.raw_input_contents.__setitem__(i, m.raw_input_contents[i] + b"\0"))
        add(lambda m, i=i: m.raw_input_contents.__setitem__(i, b""))
        add(lambda m, i=i: m.raw_input_contents.__delitem__(i))
        add(lambda m, i=i: m.inputs.__delitem__(i))
        add(lambda m, i=i: m.inputs.append(m.inputs[i]))  # twice
        add(lambda m, i=i: m.raw_input_contents.append(m.raw_input_contents[i]))
    add(lambda m: m.raw_input_contents.reverse())
    add(lambda m: setattr(m.parameters["timeout"], "int64_param", 5))
    add(lambda m: setattr(m.parameters["sequence_id"], "int64_param", 3))
    add(lambda m: setattr(m.parameters["priority"], "uint64_param", 1))
    add(lambda m: setattr(m.parameters["binary_data_output"], "bool_param", True))
    empty_final = "triton_enable_empty_final_response"  # perf_analyzer's; a stream's
    add(lambda m: setattr(m.parameters[empty_final], "bool_param", True))
    add(lambda m: setattr(m.parameters[empty_final], "string_param", "x"))
    add(lambda m: setattr(m.parameters["triton_other"], "bool_param", True))
    add(lambda m: setattr(m.parameters["custom"], "int64_param", 1))
    for key, kind, value in (("timeout", "int64_param", 5), ("custom", "int64_param", 1),
                             ("sequence_id", "int64_param", 3)):  # fmt: skip
        def both(m: Any, key: str = key, kind: str = kind, value: Any = value) -> None:
            m.parameters[empty_final].bool_param = True
            setattr(m.parameters[key], kind, value)

        add(both)
    add(lambda m: setattr(m, "id", "x" * 300))
    add(lambda m: m.outputs.add(name="S"))  # twice
    add(lambda m: m.outputs.add(name="Z"))
    add(lambda m: m.outputs.add(name=""))
    add(lambda m: setattr(m.outputs[0].parameters["classification"], "int64_param", 2))
    add(lambda m: setattr(m.outputs[0].parameters["shared_memory_region"],
                          "string_param", "r"))  # fmt: skip
    add(lambda m: m.ClearField("outputs"))
    add(lambda m: m.ClearField("inputs"))
    add(lambda m: m.ClearField("raw_input_contents"))
    return out


def test_whatever_the_plan_reads_the_general_reader_reads_alike() -> None:
    read, declined = read_and_declined(_compare(BATCHED, msg) for msg in _mutations())
    # some mutations leave a message the general reader still takes, read by the plan
    assert read and declined


@pytest.mark.parametrize("seed", range(3))
def test_random_wire_bytes_never_read_otherwise(seed: int) -> None:
    """Bytes of a plain message's encoding changed at random: whatever protobuf still
    parses, the plan reads only as the general reader does."""
    rng = random.Random(seed)
    wire = _plain().SerializeToString()
    parsed = 0
    for _ in range(400):
        mutated = bytearray(wire)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            msg = service_pb2.ModelInferRequest.FromString(bytes(mutated))
        except Exception:  # not a message: the wire refuses it before any reader
            continue
        parsed += 1
        _compare(BATCHED, msg)
    assert parsed


def test_batch_sizes_and_the_element_limit_are_the_general_readers() -> None:
    for rows in (0, 1, 8, 9):
        assert _compare(BATCHED, _plain(rows, 2)) == (1 <= rows <= 8)
    for size in (MAX_ELEMENTS, MAX_ELEMENTS + 1):
        msg = service_pb2.ModelInferRequest(model_name="m", model_version="7")
        w = msg.inputs.add(name="W", datatype="UINT8")
        w.shape.append(size)
        msg.raw_input_contents.append(bytes(size))
        assert _compare(WIDE, msg) == (size <= MAX_ELEMENTS)


def test_the_grpc_wire_plans_a_plain_message_and_leaves_the_rest_to_its_reader() -> None:
    """ModelInfer's wire asks the plan of the version the message names, parses the
    message once whichever reader looks first, and leaves a message with forwarded
    headers, or one for a version that cannot serve, to the general reader."""
    api = pytest.importorskip("appliance.adapters.grpc.api")
    wire = _plain().SerializeToString()
    asked: list[tuple[str, str]] = []

    def serving(name: str, version: str) -> Any:
        asked.append((name, version))
        return BATCHED

    payload = api._Message(wire, ())
    planned = api.INFER.plan(payload, serving, MAX_ELEMENTS)
    assert planned is not None and asked == [("m", "7")]
    servable, request, _, elements = planned
    assert servable is BATCHED and elements == 2 * 4 + 2 * 3 * 2
    assert list(request.inputs) == ["A", "B"] and request.outputs == ("S", "T")
    assert payload.message() is payload.parsed  # parsed once, kept for the reader
    assert api.INFER.plan(api._Message(wire, (("x-h", "1"),)), serving, MAX_ELEMENTS) is None
    assert api.INFER.plan(api._Message(wire, ()), lambda n, v: None, MAX_ELEMENTS) is None
    assert api.INFER.plan(api._Message(wire, ()), serving, elements - 1) is None
    form = api.INFER.read(api._Message(wire, (("x-h", "1"),)), None)
    assert form.parameters == {"x-h": "1"}


def test_the_stream_wire_plans_a_plain_message_as_the_call_does() -> None:
    """ModelStreamInfer's wire (the message already parsed by the stream) plans what
    ModelInfer's plans, alike, and leaves a stream's forwarded headers to the reader;
    the stream reads ``triton_enable_empty_final_response`` from the message itself."""
    api = pytest.importorskip("appliance.adapters.grpc.api")
    stream = pytest.importorskip("appliance.adapters.grpc.stream")
    msg = _plain()
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    wire = msg.SerializeToString()
    call = api.INFER.plan(api._Message(wire, ()), lambda n, v: BATCHED, MAX_ELEMENTS)
    streamed = stream.STREAM_INFER.plan((msg, ()), lambda n, v: BATCHED, MAX_ELEMENTS)
    assert call is not None and streamed is not None
    assert streamed[0] is call[0] is BATCHED and streamed[3] == call[3]
    assert_same_request(streamed[1], call[1])
    assert _compare(BATCHED, msg)  # and the stream's own reader reads it alike
    forwarded = (("x-h", "1"),)
    assert stream.STREAM_INFER.plan((msg, forwarded), lambda n, v: BATCHED, MAX_ELEMENTS) is None
    assert stream.STREAM_INFER.plan((msg, ()), lambda n, v: None, MAX_ELEMENTS) is None
