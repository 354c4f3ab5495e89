"""The one offload rule of the exchange (appliance/adapters/exchange.py) for each wire's
answers: text, copies and objects, on the measures of appliance/adapters/offload.py.
(The exchange itself runs in every wire's end-to-end and refusal tests.)"""

from __future__ import annotations

import numpy as np

from appliance.adapters import exchange
from appliance.adapters.grpc.api import INFER
from appliance.adapters.http import infer
from appliance.adapters.mqtt import codec
from appliance.adapters.offload import LOOP_OBJECTS, OFFLOAD_BYTES, OFFLOAD_COPY_BYTES
from appliance.adapters.request_form import OutputFormat
from appliance.core.shared_memory import SharedMemoryRef

MQTT = codec.MqttWire(None, 1 << 20)


def _floats(nbytes: int) -> dict[str, np.ndarray]:
    return {"OUT": np.zeros(nbytes // 4, np.float32)}


def test_text_is_heavy_past_the_offload_bytes_binary_views_never() -> None:
    text, binary = OutputFormat(), OutputFormat(binary_default=True)
    small, big = _floats(OFFLOAD_BYTES), _floats(OFFLOAD_BYTES + 4)
    for wire in (infer.HTTP, MQTT):
        assert not exchange.heavy_answer(small, text, wire)
        assert exchange.heavy_answer(big, text, wire)
    huge = _floats(2 * OFFLOAD_COPY_BYTES)
    assert not exchange.heavy_answer(huge, binary, infer.HTTP)  # written as views
    assert exchange.heavy_answer(huge, binary, MQTT)  # joined into one payload


def test_copies_are_heavy_past_the_copy_bytes() -> None:
    fmt = OutputFormat()
    under, over = _floats(OFFLOAD_COPY_BYTES), _floats(OFFLOAD_COPY_BYTES + 4)
    assert not exchange.heavy_answer(under, fmt, INFER)  # gRPC: raw, joined once
    assert exchange.heavy_answer(over, fmt, INFER)
    to_region = OutputFormat(shared_memory={"OUT": SharedMemoryRef("r", 0, 1 << 30)})
    assert not exchange.heavy_answer(under, to_region, infer.HTTP)
    assert exchange.heavy_answer(over, to_region, infer.HTTP)


def test_many_bytes_elements_are_heavy_on_every_wire() -> None:
    few = {"OUT": np.array([b"x"] * LOOP_OBJECTS, dtype=object)}
    many = {"OUT": np.array([b"x"] * (LOOP_OBJECTS + 1), dtype=object)}
    binary = OutputFormat(binary_default=True)
    for wire in (infer.HTTP, INFER, MQTT):
        assert not exchange.heavy_answer(few, binary, wire)
        assert exchange.heavy_answer(many, binary, wire)
