"""Triton's generate extension for any model, as Triton's own tests of it describe: a
decoupled Python model shaped like Triton's ``mock_llm`` (PROMPT, STREAM ->
TEXT, REPETITION from the request's parameters), a regular model, and the OpenAI API
on a Python model that takes text; bearer tokens as for inference."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Running

MOCK_CONFIG = """
name: "mock_llm"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [
  { name: "PROMPT" data_type: TYPE_STRING dims: [ 1, 1 ] },
  { name: "STREAM" data_type: TYPE_BOOL dims: [ 1, 1 ] }
]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1, -1 ] } ]
"""

# REPETITION responses of the prompt (1 by default), then the final flag alone when
# STREAM, else the last response carries it; FAIL_LAST sends an error last
MOCK_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            stream = bool(pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy()[0, 0])
            params = json.loads(request.parameters())
            count = int(params.get("REPETITION", 1))
            sender = request.get_response_sender()
            text = pb_utils.Tensor("TEXT", prompt.astype(object))
            for i in range(count):
                last = i == count - 1 and not stream and not params.get("FAIL_LAST")
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=[text]), flags=flags)
            if params.get("FAIL_LAST"):
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            elif stream or count == 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# a text model of the vLLM backend's shape: echoes the prompt back, word by word
ECHO_CONFIG = """
backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: text_input, data_type: TYPE_STRING, dims: [1]}
output:
  - {name: text_output, data_type: TYPE_STRING, dims: [1]}
"""

ECHO_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            sender = request.get_response_sender()
            for word in text.reshape(-1)[0].decode().split(" "):
                out = pb_utils.Tensor("text_output", np.array([word.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


# a response every 20 ms (at most 3000) until the caller goes away; then it writes
# parameters.marker and ends
TICKER_CONFIG = """
backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: START, data_type: TYPE_INT32, dims: [1]}
output:
  - {name: TICK, data_type: TYPE_INT32, dims: [1]}
"""

TICKER_PY = """
import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            marker = json.loads(request.parameters())["marker"]
            sender = request.get_response_sender()
            threading.Thread(target=self.tick, args=(sender, marker), daemon=True).start()
        return None

    def tick(self, sender, marker):
        for i in range(3000):
            if sender.is_cancelled():
                Path(marker).write_text(str(i))
                break
            tick = pb_utils.Tensor("TICK", np.array([i], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[tick]))
            time.sleep(0.02)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def _repo(root: Path) -> Path:
    for name, config, code, name_file in (
        ("mock_llm", MOCK_CONFIG, MOCK_PY, "config.pbtxt"),
        ("echo", ECHO_CONFIG, ECHO_PY, "config.yaml"),
        ("ticker", TICKER_CONFIG, TICKER_PY, "config.yaml"),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / name_file).write_text(config)
        (root / name / "1" / "model.py").write_text(code)
    return root


@pytest.fixture
def server(run_appliance: Any, tmp_path: Path) -> Running:
    running: Running = run_appliance(_repo(tmp_path))
    return running


def _post(server: Running, path: str, doc: Any, token: str = "") -> tuple[int, str, str]:
    host, port = server.url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    body = doc if isinstance(doc, str) else json.dumps(doc)
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, response.getheader("Content-Type") or "", text


def _error(server: Running, route: str, doc: Any) -> str:
    status, kind, body = _post(server, f"/v2/models/mock_llm/{route}", doc)
    assert status == 400 and kind.startswith("application/json"), body
    message: str = json.loads(body)["error"]
    return message


def _events(body: str) -> list[dict[str, Any]]:
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), body
    return [json.loads(e[len("data: ") :]) for e in events]


def test_generate_maps_members_to_inputs_and_parameters(server: Running) -> None:
    status, kind, body = _post(
        server, "/v2/models/mock_llm/generate", {"PROMPT": "hello world", "STREAM": False}
    )
    assert status == 200 and kind.startswith("application/json")
    assert json.loads(body) == {
        "model_name": "mock_llm",
        "model_version": "1",
        "TEXT": "hello world",
    }
    # a member that is no input is a parameter; so is every member of "parameters"
    for doc in (
        {"PROMPT": ["hi"], "STREAM": True, "REPETITION": 3},
        {"PROMPT": ["hi"], "STREAM": True, "parameters": {"REPETITION": 3}},
    ):
        status, kind, body = _post(server, "/v2/models/mock_llm/generate_stream", doc)
        assert status == 200 and kind.startswith("text/event-stream")
        assert [e["TEXT"] for e in _events(body)] == ["hi"] * 3


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_refusals_in_tritons_words(server: Running, route: str) -> None:
    for doc in ({}, {"abc": 123}):
        assert "expected 2 inputs but got 0 inputs" in _error(server, route, doc)
    for doc in ({"PROMPT": "hello"}, {"STREAM": False, "other": "param"}):
        assert "expected 2 inputs but got 1 inputs" in _error(server, route, doc)
    assert "non-string as string" in _error(server, route, {"PROMPT": 123, "STREAM": False})
    assert "non-boolean as boolean" in _error(server, route, {"PROMPT": "a", "STREAM": "false"})
    assert "non-string as string" in _error(server, route, {"PROMPT": True, "STREAM": 123})
    assert "non-boolean as boolean" in _error(server, route, {"STREAM": 123, "PROMPT": True})
    duplicate = '{"PROMPT": "hello", "STREAM": false, "PROMPT": "again"}'
    assert "input 'PROMPT' already exists in request" in _error(server, route, duplicate)
    nested = {"PROMPT": "hello", "STREAM": True, "PARAMS": {"PARAM_0": 0}}
    assert "parameter 'PARAMS' has invalid type" in _error(server, route, nested)
    assert "non-string as string" in _error(
        server, route, {"PROMPT": {"USER": "hello"}, "STREAM": True}
    )
    assert "malformed JSON" in _error(server, route, "{nope")


def test_generate_wants_exactly_one_response(server: Running) -> None:
    for count in (0, 2):
        doc = {"PROMPT": "hello", "STREAM": True, "REPETITION": count}
        assert "generate expects model to produce exactly 1 response" in _error(
            server, "generate", doc
        )
        status, _, body = _post(server, "/v2/models/mock_llm/generate_stream", doc)
        assert status == 200 and len(_events(body)) == count
    # one response then the final flag alone: one answer
    status, _, _ = _post(server, "/v2/models/mock_llm/generate", {"PROMPT": "a", "STREAM": True})
    assert status == 200


def test_stream_errors_are_events(server: Running) -> None:
    path = "/v2/models/mock_llm/generate_stream"
    doc = {"PROMPT": ["hello"], "STREAM": True, "REPETITION": 0, "FAIL_LAST": True}
    status, kind, body = _post(server, path, doc)
    # the error is the first response: it sets the status (a TritonError without a
    # code is INTERNAL, 500, as in Triton)
    assert status == 500 and kind.startswith("text/event-stream")
    (only,) = _events(body)
    assert list(only) == ["error"] and "An Error Occurred" in only["error"]
    doc["REPETITION"] = 1
    status, _, body = _post(server, path, doc)
    assert status == 200
    first, second = _events(body)
    assert first == {"model_name": "mock_llm", "model_version": "1", "TEXT": "hello"}
    assert list(second) == ["error"] and "An Error Occurred" in second["error"]


def test_a_regular_model_through_generate(server: Running, run_appliance: Any) -> None:
    demo = run_appliance(None)  # the built-in demo models: "simple" adds and subtracts
    doc = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}
    status, _, body = _post(demo, "/v2/models/simple/generate", doc)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["OUTPUT0"] == [i + 1 for i in range(16)]
    assert answer["OUTPUT1"] == [i - 1 for i in range(16)]
    status, _, body = _post(demo, "/v2/models/simple/generate", {**doc, "INPUT1": [1] * 3})
    assert status == 400 and "do not fit its dims" in json.loads(body)["error"]


def test_openai_api_serves_a_python_text_model(server: Running) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["echo"]  # the others take no text
    done = client.completions.create(model="echo", prompt="one two three")
    assert done.choices[0].text == "onetwothree" and done.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="echo", prompt="one two", stream=True))
    assert [c.choices[0].text for c in chunks] == ["one", "two", ""]
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError):  # a model that takes no chat
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])


def test_a_python_model_sees_the_client_leave(server: Running, tmp_path: Path) -> None:
    marker = tmp_path / "cancelled"
    doc = json.dumps({"START": 0, "parameters": {"marker": str(marker)}}).encode()
    host, port = server.url.split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v2/models/ticker/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(doc), doc)
    )
    received = b""
    while received.count(b"data: ") < 2:  # the stream is under way
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    sock.close()
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the model never saw the cancellation"
        time.sleep(0.05)
    assert 2 <= int(marker.read_text()) < 3000


def test_tokens_are_checked_before_the_body(run_appliance: Any, tmp_path: Path) -> None:
    server: Running = run_appliance(_repo(tmp_path), inference_token="s3cret")
    doc = {"PROMPT": "hello", "STREAM": False}
    for path in ("/v2/models/mock_llm/generate", "/v1/completions"):
        status, _, _ = _post(server, path, doc)
        assert status == 401
    status, _, _ = _post(server, "/v2/models/mock_llm/generate", doc, token="s3cret")
    assert status == 200
    status, _, body = _post(
        server, "/v1/completions", {"model": "echo", "prompt": "a b"}, token="s3cret"
    )
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "ab"
