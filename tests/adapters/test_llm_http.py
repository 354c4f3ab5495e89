"""A real language model (SmolLM2-135M, GGUF) served by the ``llm`` backend, end to end:
Triton's generate extension and the OpenAI-compatible API, through raw HTTP and the
official ``openai`` client, plain and streamed; cancellation mid-stream; concurrent
streams; token statistics and metrics. One model load for the whole module.

Greedy decoding (temperature 0): the same prompt gives the same text on this machine,
so the answers of the different routes are compared with each other, never with a
text written down here.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llm_models
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from conftest import Running
from http_helpers import metric_value
from mosquitto import Broker, Client, find_mosquitto, require_mosquitto

PROMPT = "The capital of France is"
MODEL = "smollm"


MQTT_PREFIX = "llmtest"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker | None]:
    """A mosquitto broker for the MQTT test, where one is installed (that test skips,
    or fails under CI, without it; the others need none)."""
    binary = find_mosquitto()
    if binary is None:
        yield None
        return
    b = Broker(binary, tmp_path_factory.mktemp("mosquitto"))
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, broker: Broker | None) -> Iterator[Running]:
    repo = llm_models.write_repository(tmp_path_factory.mktemp("llm_repo"))
    options: dict[str, Any] = {}
    if broker is not None:
        options["mqtt"] = {
            "host": "127.0.0.1",
            "port": broker.port,
            "device_id": "cam1",
            "topic_prefix": MQTT_PREFIX,
        }
    with llm_models.module_server(repo, **options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0)


def _post(server: Running, path: str, doc: Any) -> tuple[int, str, str]:
    """(status, content type, body) of one POST."""
    host, port = server.url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = doc if isinstance(doc, str) else json.dumps(doc)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, response.getheader("Content-Type") or "", text


def _events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), body
    return [e[len("data: ") :] for e in events]


def _generate(server: Running, tokens: int = 8, **params: Any) -> dict[str, Any]:
    doc = {"text_input": PROMPT, "parameters": {"max_tokens": tokens, **params}}
    status, kind, body = _post(server, f"/v2/models/{MODEL}/generate", doc)
    assert status == 200, body
    assert kind.startswith("application/json")
    result: dict[str, Any] = json.loads(body)
    return result


def test_generate_answers_one_object_and_greedy_repeats(server: Running) -> None:
    first = _generate(server)
    assert first["model_name"] == MODEL and first["model_version"] == "1"
    assert first["finish_reason"] == "length"
    assert first["num_output_tokens"] == 8 and first["num_input_tokens"] > 0
    assert first["text_output"].strip()
    assert _generate(server) == first  # greedy: the same text again
    # by version, as Triton routes it
    status, _, body = _post(
        server,
        f"/v2/models/{MODEL}/versions/1/generate",
        {"text_input": PROMPT, "parameters": {"max_tokens": 8}},
    )
    assert status == 200 and json.loads(body)["text_output"] == first["text_output"]


def test_generate_stream_sends_one_event_per_step(server: Running) -> None:
    whole = _generate(server)["text_output"]
    doc = {"text_input": PROMPT, "parameters": {"max_tokens": 8, "stream": True}}
    status, kind, body = _post(server, f"/v2/models/{MODEL}/generate_stream", doc)
    assert status == 200
    assert kind.startswith("text/event-stream")
    events = [json.loads(e) for e in _events(body)]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == whole
    assert [e["finish_reason"] for e in events][-1] == "length"
    assert all(e["finish_reason"] == "" for e in events[:-1])
    assert events[-1]["num_output_tokens"] == 8
    # without "stream": the model answers once, so the stream has one event
    status, _, body = _post(
        server,
        f"/v2/models/{MODEL}/generate_stream",
        {"text_input": PROMPT, "parameters": {"max_tokens": 8}},
    )
    assert status == 200 and [json.loads(e)["text_output"] for e in _events(body)] == [whole]


def test_generate_refusals_are_tritons_errors(server: Running) -> None:
    path = f"/v2/models/{MODEL}/generate"
    status, _, body = _post(server, path, {"parameters": {"max_tokens": 4}})
    assert status == 400 and "exactly one of the inputs" in json.loads(body)["error"]
    status, _, body = _post(server, path, '{"text_input": "a", "text_input": "b"}')
    assert status == 400 and "input 'text_input' already exists" in json.loads(body)["error"]
    status, _, body = _post(server, path, {"text_input": 5})
    assert status == 400 and "non-string as string" in json.loads(body)["error"]
    status, _, body = _post(server, path, {"text_input": PROMPT, "temperature": "hot"})
    assert status == 400 and "'temperature' must be a number" in json.loads(body)["error"]
    status, _, body = _post(server, path, {"text_input": PROMPT, "max_tokens": 10**6})
    assert status == 400 and "'max_tokens' must be between 1 and 4096" in body
    status, _, body = _post(server, "/v2/models/nosuch/generate", {"text_input": PROMPT})
    assert status == 400 and "unknown model: 'nosuch'" in json.loads(body)["error"]
    # a stream refused before the model ran is an ordinary JSON error; one the model
    # refused is its first response: an error event, with the error's status
    status, kind, body = _post(server, path + "_stream", '{"text_input": ["a", "b"]}')
    assert status == 400 and kind.startswith("application/json"), body
    status, kind, body = _post(server, path + "_stream", {"parameters": {}})
    assert status == 400 and kind.startswith("text/event-stream")
    assert "exactly one of the inputs" in json.loads(_events(body)[0])["error"]


def test_a_prompt_the_kv_cache_cannot_hold_is_refused(server: Running) -> None:
    # 64 blocks of the CPU's 32 tokens: 2,048 tokens in all
    doc = {"text_input": "word " * 2100, "parameters": {"max_tokens": 4}}
    status, _, body = _post(server, f"/v2/models/{MODEL}/generate", doc)
    assert status == 400
    assert "(2101 prompt tokens, 0 generated) does not fit the KV cache" in body
    assert _generate(server)["finish_reason"] == "length"  # the others are served on


def test_openai_client_completions_plain_and_streamed(
    server: Running, client: openai.OpenAI
) -> None:
    assert MODEL in [m.id for m in client.models.list()]
    assert client.models.retrieve(MODEL).id == MODEL
    whole = _generate(server)["text_output"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain.choices[0].text == whole
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 8
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_openai_client_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        seed=1,
        user="someone",
        frequency_penalty=0,  # fields the server does not use: tolerated
    )
    text = plain.choices[0].message.content
    assert plain.choices[0].message.role == "assistant"
    assert text and plain.usage is not None and plain.usage.completion_tokens > 0
    # the chat template came from the model's tokenizer: the prompt is much longer than
    # the question's own few tokens (it carries the template's system turn)
    assert plain.usage.prompt_tokens > 20
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stop_strings_end_the_text(server: Running, client: openai.OpenAI) -> None:
    whole = _generate(server, tokens=16)["text_output"]
    assert "." in whole  # " Paris." on this model: the stop below has work to do
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["."]
    )
    assert done.choices[0].text == whole[: whole.index(".")]
    assert done.choices[0].finish_reason == "stop"


def test_openai_errors_have_openais_shape(server: Running, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nosuch", prompt=PROMPT, max_tokens=4)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as several:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    assert "'n': 1" in str(several.value)
    status, _, body = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    error = json.loads(body)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["message"]
    status, _, body = _post(server, "/v1/completions", "{not json")
    assert status == 400 and "malformed JSON" in json.loads(body)["error"]["message"]


def _token_stats(server: Running) -> dict[str, int]:
    stats = server.call(_stats(server))
    return stats["model_stats"][0].get("token_stats", {"requests": 0, "output_tokens": 0})


async def _stats(server: Running) -> dict[str, Any]:
    return server.server.dataplane.statistics(MODEL)


def test_a_client_that_leaves_cancels_its_generation(server: Running) -> None:
    before = _token_stats(server)
    host, port = server.url.split(":")
    doc = json.dumps(
        {
            "text_input": PROMPT,
            "parameters": {"max_tokens": 400, "ignore_eos": True, "stream": True},
        }
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v2/models/smollm/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(doc), doc)
    )
    received = b""
    while b"data: " not in received:  # the first token came: generation is under way
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    sock.close()
    deadline = time.monotonic() + 120
    while _token_stats(server)["requests"] == before["requests"]:
        assert time.monotonic() < deadline, "the cancelled request never ended"
        time.sleep(0.2)
    produced = _token_stats(server)["output_tokens"] - before["output_tokens"]
    assert 0 < produced < 400  # stopped well before max_tokens
    assert _generate(server)["finish_reason"] == "length"  # the model serves on


def test_a_client_that_leaves_a_plain_completion_cancels_it(server: Running) -> None:
    before = _token_stats(server)
    executions = server.call(_stats(server))["model_stats"][0]["execution_count"]
    host, port = server.url.split(":")
    doc = json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(doc), doc)
    )
    deadline = time.monotonic() + 60
    while server.call(_stats(server))["model_stats"][0]["execution_count"] == executions:
        assert time.monotonic() < deadline, "the request never reached the model"
        time.sleep(0.05)
    sock.close()  # the request is with the engine: leave
    deadline = time.monotonic() + 120
    while _token_stats(server)["requests"] == before["requests"]:
        assert time.monotonic() < deadline, "the abandoned request never ended"
        time.sleep(0.2)
    assert 0 < _token_stats(server)["output_tokens"] - before["output_tokens"] < 400


def test_two_concurrent_streams_both_finish(client: openai.OpenAI) -> None:
    # batched together, the two requests' arithmetic differs from a request alone (other
    # shapes, other rounding), so greedy text may differ from a lone run's: what is
    # asserted is that both streams run to their end, whole
    prompts = ["The capital of France is", "Once upon a time"]
    results: dict[int, tuple[str, str | None, int]] = {}

    def run(i: int) -> None:
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        results[i] = (text, finish, usage.completion_tokens if usage else -1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == [0, 1]
    for text, finish, tokens in results.values():
        assert text.strip() and 0 < tokens <= 24
        assert finish == "stop" if tokens < 24 else finish in ("length", "stop")


def test_grpc_stream_as_tritons_vllm_clients_call_it(server: Running) -> None:
    whole = _generate(server)["text_output"]
    responses: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        client.async_stream_infer(
            MODEL,
            [text],
            parameters={"max_tokens": 8, "stream": True, "temperature": 0},
            enable_empty_final_response=True,
        )
        pieces = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            output = result.as_numpy("text_output")
            if output is not None:
                pieces.append(output[0].decode())
            if final:
                break
    finally:
        client.stop_stream()
        client.close()
    assert "".join(pieces) == whole and len(pieces) > 1


def test_mqtt_answers_a_generate_request_with_the_final_text(
    server: Running, broker: Broker | None
) -> None:
    require_mosquitto()
    assert broker is not None
    whole = _generate(server)["text_output"]  # MQTT joins the per-step texts below
    client = Client(broker.port)
    try:
        client.subscribe(f"{MQTT_PREFIX}/cam1/status")
        deadline = time.monotonic() + 30
        while client.collect(1, timeout=deadline - time.monotonic())[0].payload != b"online":
            pass
        client.subscribe(f"{MQTT_PREFIX}/replies/#")
        request = {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
            "outputs": [{"name": "text_output"}, {"name": "num_output_tokens"}],
            "parameters": {"max_tokens": 8, "stream": True},
        }
        client.publish(
            f"{MQTT_PREFIX}/cam1/infer/{MODEL}",
            json.dumps(request).encode(),
            response_topic=f"{MQTT_PREFIX}/replies/x",
        )
        (reply,) = client.collect(1, timeout=120)
    finally:
        client.close()
    outputs = {o["name"]: o["data"] for o in json.loads(reply.payload)["outputs"]}
    assert outputs == {"text_output": [whole], "num_output_tokens": [8]}


def test_token_metrics_and_statistics(server: Running) -> None:
    _generate(server)
    stats = _token_stats(server)
    assert stats["requests"] >= 1 and stats["output_tokens"] >= 8
    labels = {"model": MODEL, "version": "1"}
    url = server.metrics_url
    assert (metric_value(url, "appliance_llm_output_tokens_total", **labels) or 0) >= 8
    ttft = metric_value(url, "appliance_llm_time_to_first_token_seconds_count", **labels)
    assert ttft is not None and ttft >= 1
    itl = metric_value(url, "appliance_llm_inter_token_latency_seconds_count", **labels)
    assert itl is not None and itl >= 7


def test_the_docs_example_runs_as_written(server: Running) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "llm.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", docs, re.S)
    port = server.url.split(":")[1]
    done = subprocess.run(
        [sys.executable, "-c", code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    chat, story, generated = done.stdout.strip("\n").split("\n", 2)
    assert chat.strip() and int(chat.split()[-1]) > 0
    assert story.strip() and generated.strip()


def test_a_hot_swap_lets_a_running_stream_finish(server: Running) -> None:
    """A new config for the loaded model: a new copy (a new engine process) is built
    beside the old one, the old one's running stream ends whole, then the new copy
    answers (its default max_tokens is the new config's)."""
    host, port = server.url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    params = {"max_tokens": 200, "ignore_eos": True, "stream": True}
    body = json.dumps({"text_input": PROMPT, "parameters": params})
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body=body)
    response = conn.getresponse()
    received = response.read1(65536)  # the stream is under way
    config = {
        "backend": "llm",
        "parameters": {
            "kv_cache_blocks": {"string_value": "64"},
            "max_tokens": {"string_value": "5"},
        },
    }
    load = {"parameters": {"config": json.dumps(config)}}
    status, _, answer = _post(server, "/v2/repository/models/smollm/load", load)
    assert status == 200, answer
    received += response.read()
    conn.close()
    events = [json.loads(e) for e in _events(received.decode())]
    assert events[-1]["finish_reason"] == "length" and events[-1]["num_output_tokens"] == 200
    status, _, answer = _post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT})
    assert status == 200 and json.loads(answer)["num_output_tokens"] == 5


def test_an_engine_that_dies_fails_its_requests_and_the_model_comes_back(
    server: Running,
) -> None:
    """Last in this module: it ends the model's engine process (one this test's server
    started: the backend's own child). The running request fails, the model is not
    ready, and the server loads it again on its own (core/recovery.py)."""
    dataplane = server.server.dataplane
    version = dataplane.lifecycle.get(MODEL, "")
    engine = version._instances.instances[0].backend._proc  # the engine process
    host, port = server.url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    params = {"max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request(
        "POST",
        f"/v2/models/{MODEL}/generate_stream",
        body=json.dumps({"text_input": PROMPT, "parameters": params}),
    )
    response = conn.getresponse()
    received = response.read1(65536)  # under way
    engine.kill()
    received += response.read()
    conn.close()
    last = json.loads(_events(received.decode())[-1])
    assert "the LLM engine stopped" in last["error"]
    assert not dataplane.model_ready(MODEL)
    status, _, body = _post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT})
    assert status == 503 and "smollm" in json.loads(body)["error"]
    deadline = time.monotonic() + 300  # a bound for a hang, not a timing assertion
    while not dataplane.model_ready(MODEL):
        assert time.monotonic() < deadline, "the model was not loaded again"
        time.sleep(0.1)
    assert dataplane.lifecycle.get(MODEL, "") is not version  # a new copy, a new engine
    assert _generate(server)["finish_reason"] == "length"
