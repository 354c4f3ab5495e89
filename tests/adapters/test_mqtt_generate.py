"""A decoupled text model over MQTT: one request, one reply with the final text (the
responses' text joined), and the request's parameters reach the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from mosquitto import Broker, Client, require_mosquitto
from test_mqtt import mqtt_options, new_prefix, wait_online

CONFIG = """
backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: text_input, data_type: TYPE_STRING, dims: [1]}
output:
  - {name: text_output, data_type: TYPE_STRING, dims: [1]}
  - {name: count, data_type: TYPE_INT32, dims: [1]}
"""

# a response per word of the prompt, then parameters.suffix; "count": words so far
MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            words = text.reshape(-1)[0].decode().split(" ")
            words.append(json.loads(request.parameters()).get("suffix", ""))
            sender = request.get_response_sender()
            for i, word in enumerate(words):
                out = pb_utils.Tensor("text_output", np.array([word.encode()], dtype=object))
                count = pb_utils.Tensor("count", np.array([i + 1], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out, count]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    (tmp_path / "mosquitto").mkdir()
    b = Broker(require_mosquitto(), tmp_path / "mosquitto")
    b.start()
    yield b
    b.stop()


@pytest.fixture
def client() -> Iterator[Callable[[int], Client]]:
    made: list[Client] = []

    def make(port: int) -> Client:
        made.append(Client(port))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_decoupled_text_model_answers_once_with_the_final_text(
    run_appliance: Any, broker: Broker, client: Callable[[int], Client], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    (repo / "words" / "1").mkdir(parents=True)
    (repo / "words" / "config.yaml").write_text(CONFIG)
    (repo / "words" / "1" / "model.py").write_text(MODEL)
    prefix = new_prefix()
    run_appliance(repo, mqtt=mqtt_options(broker.port, "cam1", topic_prefix=prefix))
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies/#")
    request = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["one two three"]}
        ],
        "parameters": {"suffix": "!"},
    }
    c.publish(
        f"{prefix}/cam1/infer/words", orjson.dumps(request), response_topic=f"{prefix}/replies/x"
    )
    (reply,) = c.collect(1)
    outputs = {o["name"]: o["data"] for o in orjson.loads(reply.payload)["outputs"]}
    assert outputs == {"text_output": ["onetwothree!"], "count": [4]}
