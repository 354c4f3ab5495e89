"""The plain-request plan against the general KServe reader, its oracle: whatever the
plan reads, the general reader (parse, declare, build) decodes to the same request;
what the general reader refuses, the plan leaves to it (None)."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from appliance.adapters import request_form
from appliance.adapters.codec import kserve
from appliance.adapters.codec.kserve_plan import Plan, plan_of
from appliance.config.model_config import parse_model_config
from appliance.core.admission import Ticket
from appliance.core.limits import RequestRules
from appliance.core.queue_bytes import QueuedBytes
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError
from appliance.request import InferenceRequest

MAX_ELEMENTS = 4096


class _Version:
    """What the plan and a ticket read of a model version."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = parse_model_config(config, config["name"], "test")
        self.version = 1
        self.rules = RequestRules(self.config)
        self.stats = ModelStats(self.config.name, "1")


BATCHED = _Version(
    {
        "name": "add",
        "max_batch_size": 8,
        "input": [
            {"name": "A", "data_type": "TYPE_INT32", "dims": [4]},
            {"name": "B", "data_type": "TYPE_FP32", "dims": [-1, 2]},
        ],
        "output": [
            {"name": "S", "data_type": "TYPE_INT32", "dims": [4]},
            {"name": "T", "data_type": "TYPE_FP32", "dims": [-1, 2]},
        ],
    }
)
FIXED = _Version(
    {
        "name": "fixed",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_FP64", "dims": [3]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP64", "dims": [3]}],
    }
)


def _ticket(version: _Version) -> Ticket:
    hold = QueuedBytes(1 << 30).hold(version.stats)
    return Ticket(version, version.rules, hold, MAX_ELEMENTS)  # type: ignore[arg-type]


def _body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()  # (the standard encoder: integers of any size)
    return head + b"".join(chunks), len(head)


def _plain_batched(rows: int = 2, cols: int = 3) -> tuple[dict[str, Any], list[bytes]]:
    a = np.arange(rows * 4, dtype="<i4").tobytes()
    b = np.linspace(0, 1, rows * cols * 2, dtype="<f4").tobytes()
    header = {
        "inputs": [
            {"name": "A", "datatype": "INT32", "shape": [rows, 4],
             "parameters": {"binary_data_size": len(a)}},
            {"name": "B", "datatype": "FP32", "shape": [rows, cols, 2],
             "parameters": {"binary_data_size": len(b)}},
        ],
        "outputs": [{"name": "S", "parameters": {"binary_data": True}}, {"name": "T"}],
    }  # fmt: skip
    return header, [a, b]


def _compare(version: _Version, body: bytes, header_length: int) -> bool:
    """Both readers on one body: the plan's request equals the general one's whenever
    the plan reads it, and the plan reads nothing the general reader refuses. True
    when the plan read it."""

    async def both() -> bool:
        plan = plan_of(version)  # type: ignore[arg-type]
        assert plan is not None
        quick = plan.read(body, header_length, _ticket(version), "m", "7")
        try:
            ticket = _ticket(version)
            form = kserve.parse_request(body, header_length, "m", "7")
            request_form.declare(form, ticket, None)
            general = request_form.build(form, None)
            version.rules.check(general, ticket.trusts(version))  # type: ignore[arg-type]
        except ApplianceError:
            assert quick is None, "the plan read a body the general reader refuses"
            return False
        if quick is None:
            return False
        request, fmt = quick
        assert (request.model_name, request.model_version) == ("m", "7")
        assert (fmt.binary, fmt.binary_default, fmt.shared_memory) == (
            form.fmt.binary, form.fmt.binary_default, form.fmt.shared_memory,
        )  # fmt: skip
        assert_same_request(request, general)
        return True

    return asyncio.run(both())


def assert_same_request(request: InferenceRequest, general: InferenceRequest) -> None:
    """The plan's request is the general reader's: names, outputs, settings, and each
    input's dtype, shape and values, in the same order."""
    assert (request.model_name, request.model_version) == (
        general.model_name, general.model_version,
    )  # fmt: skip
    assert (request.outputs, request.id) == (general.outputs, general.id)
    assert (request.timeout_us, request.parameters, request.priority) == (
        general.timeout_us, general.parameters, general.priority,
    )  # fmt: skip
    assert (request.sequence_id, request.classification) == (
        general.sequence_id, general.classification,
    )  # fmt: skip
    assert list(request.inputs) == list(general.inputs)
    for name, arr in general.inputs.items():
        got = request.inputs[name]
        assert (got.dtype, got.shape) == (arr.dtype, arr.shape)
        assert np.array_equal(got, arr)


def test_a_plain_binary_request_reads_as_the_general_reader_reads_it() -> None:
    for rows, cols in ((1, 1), (2, 3), (8, 5)):
        header, chunks = _plain_batched(rows, cols)
        assert _compare(BATCHED, *_body(header, *chunks))
    header, chunks = _plain_batched()
    del header["outputs"]
    header["id"] = "request-7"
    assert _compare(BATCHED, *_body(header, *chunks))
    x = np.array([1.5, -2.0, 3.25], dtype="<f8").tobytes()
    fixed = {"inputs": [{"name": "X", "datatype": "FP64", "shape": [3],
                         "parameters": {"binary_data_size": 24}}]}  # fmt: skip
    assert _compare(FIXED, *_body(fixed, x))


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _mutations(header: dict[str, Any], chunks: list[bytes]) -> list[tuple[bytes, int]]:
    """Bodies one change away from a plain one: each is refused by the general reader,
    means something the plan leaves to it, or is still plain."""
    out: list[tuple[bytes, int]] = []

    def add(change: Any, tail: bytes = b"") -> None:
        h = copy.deepcopy(header)
        change(h)
        body, length = _body(h, *chunks)
        out.append((body + tail, length))

    def put(path: tuple[Any, ...], value: Any) -> None:
        add(lambda h: _at(h, path[:-1]).__setitem__(path[-1], value))

    def drop(path: tuple[Any, ...]) -> None:
        add(lambda h: _at(h, path[:-1]).pop(path[-1]))

    values: list[Any] = [None, True, 1.0, -1, 0, 9, 2**70, "2", [2], {}, [], "", "A"]
    for i in (0, 1):
        for key in ("name", "datatype", "shape", "parameters"):
            for value in values:
                put(("inputs", i, key), value)
            drop(("inputs", i, key))
        for dim in range(3 if i else 2):
            for value in (0, 1, 3, 9, -1, True, 2.0, "2", 2**63):
                put(("inputs", i, "shape", dim), value)
        for value in [*values, False, 2**63, -8]:
            put(("inputs", i, "parameters", "binary_data_size"), value)
        put(("inputs", i, "parameters", "shared_memory_region"), "r")
        put(("inputs", i, "data"), [1, 2])
        add(lambda h, i=i: h["inputs"].append(copy.deepcopy(h["inputs"][i])))  # twice
        drop(("inputs", i))
    add(lambda h: h["inputs"].reverse())
    put(("inputs",), {"A": 1})
    put(("parameters",), {"binary_data_output": True})
    put(("parameters",), {"timeout": 5})
    put(("id",), 7)
    put(("model",), "x")
    for value in (
        [{"name": "S"}, {"name": "S"}], [{"name": "Z"}], [{"name": 1}], ["S"], {"S": 1},
        [{"name": "S", "parameters": {"binary_data": 1}}],
        [{"name": "S", "parameters": {"classification": 2}}],
        [{"name": "S", "parameters": {}}], [{"name": "S", "extra": 1}], [],
    ):  # fmt: skip
        put(("outputs",), value)
    add(lambda h: None, b"\0")  # a byte more
    return out


def read_and_declined(outcomes: Iterable[bool]) -> tuple[int, int]:
    """How many of the compared cases the plan read, and how many it left to the
    general reader (each comparison: True when the plan read it)."""
    seen = list(outcomes)
    return sum(seen), len(seen) - sum(seen)


def test_whatever_the_plan_reads_the_general_reader_reads_alike() -> None:
    header, chunks = _plain_batched()
    read, declined = read_and_declined(
        _compare(BATCHED, body, length) for body, length in _mutations(header, chunks)
    )
    # a rotated or resized body the general reader still takes, read by the plan
    assert read and declined


@pytest.mark.parametrize("seed", range(3))
def test_random_bodies_never_read_otherwise(seed: int) -> None:
    """Bytes of a plain body changed at random (its JSON header, its length): the plan
    reads a body only as the general reader does."""
    rng = random.Random(seed)
    header, chunks = _plain_batched()
    body, length = _body(header, *chunks)
    for _ in range(300):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(length)] = rng.randrange(32, 127)
        cut = length + rng.choice((0, 0, 0, -1, 1, 4))
        _compare(BATCHED, bytes(mutated), max(1, min(cut, len(mutated))))


def test_batch_sizes_are_the_general_readers() -> None:
    """Well-formed bodies (sizes that add up) whose batch the model takes or refuses."""
    for rows in (0, 1, 8, 9):
        header, chunks = _plain_batched(rows, 2)
        assert _compare(BATCHED, *_body(header, *chunks)) == (1 <= rows <= 8)
    header, chunks = _plain_batched(2, 2)
    other, more = _plain_batched(3, 2)  # A of 2 rows, B of 3: they disagree
    header["inputs"][1] = other["inputs"][1]
    assert not _compare(BATCHED, *_body(header, chunks[0], more[1]))


# one input of any length: the server's element limit decides
WIDE = _Version(
    {
        "name": "wide",
        "max_batch_size": 0,
        "input": [{"name": "W", "data_type": "TYPE_UINT8", "dims": [-1]}],
        "output": [{"name": "V", "data_type": "TYPE_UINT8", "dims": [-1]}],
    }
)


def test_the_element_limit_is_the_general_readers() -> None:
    for size in (MAX_ELEMENTS, MAX_ELEMENTS + 1):
        header = {"inputs": [{"name": "W", "datatype": "UINT8", "shape": [size],
                              "parameters": {"binary_data_size": size}}]}  # fmt: skip
        assert _compare(WIDE, *_body(header, bytes(size))) == (size <= MAX_ELEMENTS)


def test_models_a_plain_request_means_more_to_are_left_to_the_general_reader() -> None:
    def version(**input_fields: Any) -> Any:
        spec = {"name": "I", "data_type": "TYPE_FP32", "dims": [2], **input_fields}
        output = {"name": "O", "data_type": "TYPE_FP32", "dims": [2]}
        return _Version({"name": "v", "max_batch_size": 4, "input": [spec], "output": [output]})

    assert Plan.applies(version())  # type: ignore[arg-type]
    assert not Plan.applies(version(data_type="TYPE_STRING"))  # type: ignore[arg-type]
    assert not Plan.applies(version(optional=True))  # type: ignore[arg-type]
    assert not Plan.applies(version(reshape={"shape": [1, 2]}))  # type: ignore[arg-type]


def test_the_http_wire_takes_the_plan_for_a_plain_body_only() -> None:
    from appliance.adapters.http import infer

    header, chunks = _plain_batched()
    body, length = _body(header, *chunks)

    async def quick(field: str | None, forwarded: tuple[tuple[str, str], ...] = ()) -> Any:
        return infer.HTTP.quick((body, field, "add", "", forwarded), _ticket(BATCHED))

    async def cases() -> list[Any]:
        return [
            await quick(str(length)),
            await quick(None),  # a JSON body: read the general way
            await quick(f" {length}"),
            await quick("²"),
            await quick(str(length), (("x-trace", "1"),)),  # forwarded headers: parameters
        ]

    plain, *others = asyncio.run(cases())
    assert plain is not None and plain[0].model_name == "add"
    assert others == [None] * 4
