"""The MQTT bridge, end to end through a real mosquitto broker, plus its pure rules.

Each end-to-end test uses its own topic prefix and device ids on a shared broker
(tests that restart a broker get their own). Every wait is bounded; replies are
matched by their v5 correlation data.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from docs_examples import examples
from mosquitto import Broker, Client, Reply, free_port, mqtt_metrics, require_mosquitto, wait_until

from appliance.adapters.mqtt.codec import payload_form, read_device_file
from appliance.adapters.mqtt.protocol import DedupWindow, Inbound, Topics, backoff_delay
from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from devtools import modelgen

HEADER = "Inference-Header-Content-Length"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(256)) * 4 + b"\xff\xd9"
A = np.arange(16, dtype=np.int32).reshape(1, 16)
SLOW_DELAY_S = 3.0  # the "slow" model holds a lone request this long, waiting for a batch

SLOW_CONFIG = f"""
backend: onnxruntime
max_batch_size: 8
input: [{{name: INPUT0, data_type: TYPE_FP32, dims: [-1]}}]
output: [{{name: OUTPUT0, data_type: TYPE_FP32, dims: [-1]}}]
dynamic_batching: {{max_queue_delay_microseconds: {int(SLOW_DELAY_S * 1e6)}}}
"""

# ---- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mosquitto_binary() -> str:
    return require_mosquitto()


@pytest.fixture
def make_broker(mosquitto_binary: str, tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    made: list[Broker] = []

    def make(persistence: bool = False, start: bool = True, extra: tuple[str, ...] = ()) -> Broker:
        workdir = tmp_path / f"broker{len(made)}"
        workdir.mkdir()
        broker = Broker(mosquitto_binary, workdir, persistence, extra)
        made.append(broker)
        if start:
            broker.start()
        return broker

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture(scope="module")
def broker(mosquitto_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(mosquitto_binary, tmp_path_factory.mktemp("mosquitto"))
    b.start()
    yield b
    b.stop()


@pytest.fixture
def client() -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(port: int, session: bool = False) -> Client:
        made.append(Client(port, session))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def mqtt_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("mqtt_repo")
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    modelgen.write_model(repo, "identity_bytes", modelgen.identity("BYTES", [-1]))
    modelgen.write_model(repo, "slow", modelgen.identity("FP32", [-1]), SLOW_CONFIG)
    modelgen.write_model(repo, "simple_fp32", modelgen.identity("FP32", [-1]))
    return repo


_prefixes = iter(range(10**6))


def mqtt_options(port: int, device: str, **extra: Any) -> dict[str, Any]:
    options = {
        "host": "127.0.0.1",
        "port": port,
        "device_id": device,
        "topic_prefix": extra.pop("topic_prefix"),
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.5,
        "keepalive_s": 5,
        "session_expiry_s": 60,
    }
    options.update(extra)
    return options


def new_prefix() -> str:
    return f"test{os.getpid()}/p{next(_prefixes)}"


def wait_online(c: Client, prefix: str, device: str) -> None:
    """The bridge publishes the retained 'online' after subscribing: once we see it,
    requests reach it."""
    status = f"{prefix}/{device}/status"
    c.subscribe(status)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        reply = c.collect(1, timeout=end - time.monotonic())[0]
        if reply.topic == status and reply.payload == b"online":
            return
    raise AssertionError(f"{device} never came online")


def json_request(a: np.ndarray, b: np.ndarray, request_id: str = "") -> bytes:
    doc: dict[str, Any] = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": list(x.shape), "data": x.ravel().tolist()}
            for n, x in (("INPUT0", a), ("INPUT1", b))
        ]
    }
    if request_id:
        doc["id"] = request_id
    return orjson.dumps(doc)


def outputs(reply: Reply) -> dict[str, Any]:
    doc = orjson.loads(reply.payload)
    assert "error" not in doc, doc
    return {o["name"]: o for o in doc["outputs"]}


def start(run_appliance: Any, repo: Path, port: int, device: str, prefix: str, **kw: Any) -> Any:
    server_options = {k: kw.pop(k) for k in ("shared_memory",) if k in kw}
    return run_appliance(
        repo, mqtt=mqtt_options(port, device, topic_prefix=prefix, **kw), **server_options
    )


# ---- the pure rules ---------------------------------------------------------------------


def test_mqtt_config_defaults_overrides_and_errors(tmp_path: Path) -> None:
    assert load_server_config(None, {}).mqtt is None
    cfg = load_server_config(None, {"mqtt": {"host": "broker.local"}}).mqtt
    assert cfg is not None and cfg.port == 1883 and cfg.qos == 1
    assert cfg.device_id and cfg.client_id == cfg.device_id and cfg.topic_prefix == "appliance"
    cfg = load_server_config(None, {"mqtt_broker": "10.0.0.5:1884"}).mqtt
    assert cfg is not None and (cfg.host, cfg.port) == ("10.0.0.5", 1884)
    (tmp_path / "frames").mkdir()
    (tmp_path / "appliance.yaml").write_text(
        "mqtt:\n  host: a\n  device_id: cam1\n  file_directory: frames\n  models: [simple]\n"
    )
    cfg = load_server_config(tmp_path / "appliance.yaml", {"mqtt_broker": "b:2000"}).mqtt
    assert cfg is not None and (cfg.host, cfg.port, cfg.device_id) == ("b", 2000, "cam1")
    assert cfg.file_directory == tmp_path / "frames" and cfg.models == ("simple",)
    bad = [
        ({"mqtt": {"host": "h", "qos": 2}}, "<command line>: mqtt.qos: expected 0 or 1"),
        ({"mqtt": {"host": "h", "topic_prefix": "a/#"}}, "mqtt.topic_prefix: expected"),
        ({"mqtt": {"host": "h", "device_id": "a/b"}}, "mqtt.device_id: expected"),
        ({"mqtt": {"host": "h", "bogus": 1}}, "mqtt.bogus: unknown field"),
        ({"mqtt": {"host": "h", "tls": {"ca_file": "/nope.pem"}}}, "mqtt.tls.ca_file: expected"),
        ({"mqtt": {"port": 1883}}, "mqtt.host: expected"),
        ({"mqtt_broker": "nohost"}, "--mqtt-broker: expected HOST:PORT"),
        ({"mqtt": {"host": "h", "reconnect_min_s": 0}}, "mqtt.reconnect_min_s: expected"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            load_server_config(None, overrides)


def test_the_docs_state_the_default_topic_prefix() -> None:
    import re

    docs = (Path(__file__).resolve().parents[2] / "docs" / "mqtt.md").read_text()
    cfg = load_server_config(None, {"mqtt": {"host": "h", "device_id": "cam-gate-3"}}).mqtt
    assert cfg is not None
    stated = re.search(r"topic_prefix: \S+ +# default: (\S+) ", docs)
    assert stated and stated.group(1) == cfg.topic_prefix
    assert f"`{cfg.topic_prefix}/cam-gate-3/infer/<model>` by default" in docs


def test_topics_forms_dedup_backoff_and_file_rules(tmp_path: Path) -> None:
    t = Topics("site/a", "cam1", "fleet")
    assert t.subscriptions() == [
        "site/a/cam1/infer/+",
        "site/a/cam1/infer/+/+",
        "$share/fleet/site/a/infer/+",
        "$share/fleet/site/a/infer/+/+",
    ]
    assert t.status == "site/a/cam1/status" and t.result("m") == "site/a/cam1/result/m"
    assert (t.parse("site/a/cam1/infer/m/2").model, t.parse("site/a/cam1/infer/m/2").version) == (
        "m",
        "2",
    )
    assert t.parse("site/a/infer/m").shared
    assert Topics("p", "d", models=("m",)).subscriptions() == ["p/d/infer/m", "p/d/infer/m/+"]
    assert payload_form(Inbound("t", b' {"inputs": []}')) == "json"
    assert payload_form(Inbound("t", JPEG)) == "raw"
    assert payload_form(Inbound("t", b"{", content_type="application/octet-stream")) == "raw"
    assert payload_form(Inbound("t", b"x", user_properties={HEADER.lower(): "1"})) == "binary"

    now = [0.0]
    window = DedupWindow(window_s=10, max_entries=3, clock=lambda: now[0])
    assert not window.seen("a") and window.seen("a")
    for key in "bcd":  # pushes "a" out: memory stays bounded
        assert not window.seen(key)
    assert len(window) == 3 and not window.seen("a")
    now[0] = 11.0  # older than the window: forgotten
    assert not window.seen("d") and len(window) == 1  # every older key expired

    ceilings = [min(8.0, 0.5 * 2**n) for n in range(6)]
    for n, ceiling in enumerate(ceilings):
        assert backoff_delay(n, 0.5, 8.0, lambda: 0.0) == ceiling / 2
        assert backoff_delay(n, 0.5, 8.0, lambda: 1.0) == ceiling
    assert backoff_delay(3, 0.5, 8.0, lambda: 0.1) != backoff_delay(3, 0.5, 8.0, lambda: 0.9)

    root = tmp_path / "frames"
    root.mkdir()
    (root / "f.jpg").write_bytes(JPEG)
    (tmp_path / "secret").write_bytes(b"s")
    (root / "link").symlink_to(tmp_path / "secret")
    assert read_device_file(root, "f.jpg", 10**6, "x") == JPEG
    assert read_device_file(root, str(root / "f.jpg"), 10**6, "x") == JPEG
    for name in ("../secret", str(tmp_path / "secret"), "link"):
        with pytest.raises(Exception, match="outside the file directory"):
            read_device_file(root, name, 10**6, "x")
    with pytest.raises(Exception, match="not enabled"):
        read_device_file(None, "f.jpg", 10**6, "x")
    with pytest.raises(Exception, match="over 10"):
        read_device_file(root, "f.jpg", 10, "x")


# ---- end to end through the broker ------------------------------------------------------


def test_json_request_with_v5_response_topic(run_appliance, broker, client, mqtt_repository):
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies/#")
    b = np.full((1, 16), 3, np.int32)
    for i, topic in enumerate(("infer/simple", "infer/simple/1")):
        c.publish(
            f"{prefix}/cam1/{topic}",
            json_request(A, b, request_id=f"req-{i}"),
            response_topic=f"{prefix}/replies/x",
            correlation=f"c{i}".encode(),
        )
        reply = c.collect(1)[0]
        assert reply.topic == f"{prefix}/replies/x" and reply.correlation == f"c{i}".encode()
        assert reply.content_type == "application/json" and reply.user["device-id"] == "cam1"
        doc = orjson.loads(reply.payload)
        assert doc["id"] == f"req-{i}" and doc["model_name"] == "simple"
        out = outputs(reply)
        assert out["OUTPUT0"]["data"] == (A + b).ravel().tolist()
        assert out["OUTPUT1"]["data"] == (A - b).ravel().tolist()
    m = mqtt_metrics(srv)
    assert m["connected"] == 1 and m["received"] == 2 and m["answered"] == 2 and m["errors"] == 0


def test_binary_extension_request_and_reply(run_appliance, broker, client, mqtt_repository):
    prefix = new_prefix()
    start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    b = np.full((1, 16), 5, np.int32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": n,
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": 64},
                }
                for n in ("INPUT0", "INPUT1")
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    )
    c.publish(
        f"{prefix}/cam1/infer/simple",
        header + A.tobytes() + b.tobytes(),
        response_topic=f"{prefix}/replies",
        correlation=b"bin",
        user=[(HEADER, str(len(header)))],
    )
    reply = c.collect(1)[0]
    assert reply.correlation == b"bin" and reply.content_type == "application/octet-stream"
    length = int(reply.user[HEADER])
    doc = orjson.loads(reply.payload[:length])
    assert [o["name"] for o in doc["outputs"]] == ["OUTPUT0"]
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 64
    got = np.frombuffer(reply.payload[length:], np.int32).reshape(1, 16)
    np.testing.assert_array_equal(got, A + b)


def test_raw_payloads_to_a_bytes_model_and_default_result_topic(
    run_appliance, broker, client, mqtt_repository
):
    prefix = new_prefix()
    start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies", f"{prefix}/cam1/result/#")
    text = "plate AB-123 \u2713\nframe 7".encode()  # raw BYTES: not JSON, no header
    other = b"plate XY-9"
    c.publish(
        f"{prefix}/cam1/infer/identity_bytes",
        text,
        response_topic=f"{prefix}/replies",
        correlation=b"raw",
    )
    c.publish(f"{prefix}/cam1/infer/identity_bytes", other, content_type="text/plain")
    replies = {r.topic: r for r in c.collect(2)}
    for topic, sent in (
        (f"{prefix}/replies", text),
        (f"{prefix}/cam1/result/identity_bytes", other),  # no response topic
    ):
        reply = replies[topic]
        length = int(reply.user[HEADER])  # BYTES outputs come back binary: they may not be text
        doc = orjson.loads(reply.payload[:length])
        assert doc["outputs"][0]["shape"] == [1, 1]
        element = reply.payload[length:]
        assert struct.unpack("<I", element[:4])[0] == len(sent) and element[4:] == sent
    assert replies[f"{prefix}/replies"].correlation == b"raw"
    assert replies[f"{prefix}/cam1/result/identity_bytes"].correlation is None
    # a JPEG reaches the model whole, as its one BYTES element; ONNX Runtime's string
    # tensors are UTF-8 only, so this identity model refuses it by name
    c.publish(
        f"{prefix}/cam1/infer/identity_bytes",
        JPEG,
        response_topic=f"{prefix}/replies",
        correlation=b"jpeg",
        content_type="image/jpeg",
    )
    reply = c.collect(1)[0]
    assert reply.correlation == b"jpeg" and reply.user["error-code"] == "INVALID_ARG"
    assert "input 'INPUT0'" in orjson.loads(reply.payload)["error"]
    assert "UTF-8" in orjson.loads(reply.payload)["error"]


def test_file_and_shared_memory_references(
    run_appliance, broker, client, mqtt_repository, tmp_path
):
    prefix = new_prefix()
    frames = tmp_path / "frames"
    frames.mkdir()
    (frames / "plate.txt").write_bytes("AB-123 \u2713".encode())
    (frames / "a.raw").write_bytes(A.tobytes())
    (tmp_path / "secret.raw").write_bytes(A.tobytes())
    srv = start(
        run_appliance,
        mqtt_repository,
        broker.port,
        "cam1",
        prefix,
        file_directory=str(frames),
        shared_memory="system",
    )
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")

    def ask(model: str, doc: dict[str, Any], corr: bytes) -> Reply:
        c.publish(
            f"{prefix}/cam1/infer/{model}",
            orjson.dumps(doc),
            response_topic=f"{prefix}/replies",
            correlation=corr,
        )
        reply = c.collect(1)[0]
        assert reply.correlation == corr
        return reply

    def file_input(name: str, path: str) -> dict[str, Any]:
        return {
            "name": name,
            "datatype": "INT32",
            "shape": [1, 16],
            "parameters": {"file_path": path},
        }

    ones = {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
    out = outputs(ask("simple", {"inputs": [file_input("INPUT0", "a.raw"), ones]}, b"f1"))
    assert out["OUTPUT0"]["data"] == (A + 1).ravel().tolist()
    text_in = {
        "name": "INPUT0",
        "datatype": "BYTES",
        "shape": [1, 1],
        "parameters": {"file_path": "plate.txt"},
    }
    reply = ask("identity_bytes", {"inputs": [text_in]}, b"f2")
    assert outputs(reply)["OUTPUT0"]["data"] == ["AB-123 \u2713"]  # the whole file, one element
    for i, path in enumerate(("../secret.raw", str(tmp_path / "secret.raw"), "missing.raw")):
        reply = ask("simple", {"inputs": [file_input("INPUT0", path), ones]}, b"bad%d" % i)
        error = orjson.loads(reply.payload)["error"]
        assert "outside the file directory" in error or "does not exist" in error
        assert reply.user["error-code"] == "INVALID_ARG"

    key = f"/appliance_mqtt_{os.getpid()}"
    region = shm.create_shared_memory_region("frame", key, 64)
    try:
        shm.set_shared_memory_region(region, [A])
        http = httpclient.InferenceServerClient(srv.url)
        http.register_system_shared_memory("frame", key, 64)
        shm_in = {
            "name": "INPUT0",
            "datatype": "INT32",
            "shape": [1, 16],
            "parameters": {"shared_memory_region": "frame", "shared_memory_byte_size": 64},
        }
        out = outputs(ask("simple", {"inputs": [shm_in, ones]}, b"shm"))
        assert out["OUTPUT1"]["data"] == (A - 1).ravel().tolist()
        http.unregister_system_shared_memory("frame")
    finally:
        shm.destroy_shared_memory_region(region)


def test_malformed_payloads_each_get_an_error_and_the_bridge_goes_on(
    run_appliance, broker, client, mqtt_repository
):
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    good = json_request(A, A)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": 64},
                }
            ]
        }
    )
    cases = [  # (model, payload, user properties, expected code, words in the message)
        ("simple", b'{"inputs": [', [], "INVALID_ARG", "malformed JSON"),
        ("simple", json_request(A[:, :8], A[:, :8]), [], "INVALID_ARG", "shape"),
        ("no_such_model", good, [], "INVALID_ARG", "no_such_model"),
        (
            "simple",
            header + A.tobytes()[:10],
            [(HEADER, str(len(header)))],
            "INVALID_ARG",
            "truncated",
        ),
        ("simple", good, [(HEADER, "lots")], "INVALID_ARG", HEADER),
        ("simple", JPEG, [], "INVALID_ARG", "BYTES input"),
    ]
    for i, (model, payload, user, code, words) in enumerate(cases):
        c.publish(
            f"{prefix}/cam1/infer/{model}",
            payload,
            response_topic=f"{prefix}/replies",
            correlation=f"bad{i}".encode(),
            user=user,
        )
        reply = c.collect(1)[0]
        assert reply.correlation == f"bad{i}".encode()
        doc = orjson.loads(reply.payload)
        assert list(doc) == ["error"] and words in doc["error"], (i, doc)
        assert reply.user["error-code"] == code
    c.publish(
        f"{prefix}/cam1/infer/simple", good, response_topic=f"{prefix}/replies", correlation=b"ok"
    )
    reply = c.collect(1)[0]
    assert (
        reply.correlation == b"ok" and outputs(reply)["OUTPUT0"]["data"] == (2 * A).ravel().tolist()
    )
    m = mqtt_metrics(srv)
    assert m["errors"] == len(cases) and m["answered"] == 1 and m["received"] == len(cases) + 1


def test_duplicate_qos1_delivery_is_answered_once(run_appliance, broker, client, mqtt_repository):
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    topic = f"{prefix}/cam1/infer/simple"
    for _ in range(2):  # the same request twice: by correlation data...
        c.publish(topic, json_request(A, A), response_topic=f"{prefix}/replies", correlation=b"dup")
    for _ in range(2):  # ...and, without correlation data, by request id
        c.publish(
            topic, json_request(A, A, request_id="frame-7"), response_topic=f"{prefix}/replies"
        )
    replies = c.collect(2)
    assert sorted((r.correlation or b"") for r in replies) == [b"", b"dup"]
    wait_until(lambda: mqtt_metrics(srv)["duplicates"] == 2, what="two duplicates counted")
    assert c.none_within(0.3) == []  # both duplicates were handled: no more replies coming
    stats = httpclient.InferenceServerClient(srv.url).get_inference_statistics("simple")
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 2


def test_expired_message_is_dropped_not_inferred(run_appliance, broker, client, mqtt_repository):
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    # "slow" would hold it SLOW_DELAY_S for a batch; it expires first (1-2 s left at delivery)
    c.publish(
        f"{prefix}/cam1/infer/slow",
        orjson.dumps(request),
        response_topic=f"{prefix}/replies",
        correlation=b"late",
        expiry_s=2,
    )
    wait_until(
        lambda: mqtt_metrics(srv)['dropped{reason="expired"}'] == 1,
        timeout=SLOW_DELAY_S,
        what="expiry",
    )
    stats = httpclient.InferenceServerClient(srv.url).get_inference_statistics("slow")[
        "model_stats"
    ][0]
    assert stats["inference_count"] == 0 and stats["inference_stats"]["success"]["count"] == 0
    m = mqtt_metrics(srv)
    assert m["answered"] == 0 and m["errors"] == 0
    assert c.replies.empty()


def test_qos1_backlog_waits_at_the_broker_not_overloaded(
    run_appliance, broker, client, mqtt_repository
):
    # the bridge's CONNECT says Receive Maximum = max_pending: the broker sends two
    # unacknowledged requests at a time and keeps the other three until answered
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix, max_pending=2)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    request = orjson.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [7]}]}
    )
    for i in range(5):
        c.publish(
            f"{prefix}/cam1/infer/simple_fp32",
            request,
            response_topic=f"{prefix}/replies",
            correlation=b"%d" % i,
            wait=False,
        )
    replies = c.collect(5, timeout=30)
    assert all(outputs(r)["OUTPUT0"]["data"] == [7.0] for r in replies)
    assert {r.correlation for r in replies} == {b"0", b"1", b"2", b"3", b"4"}
    m = mqtt_metrics(srv)
    assert m['dropped{reason="overloaded"}'] == 0 and m["answered"] == 5


def test_overload_is_answered_at_once_not_buffered(run_appliance, broker, client, mqtt_repository):
    # QoS 0 requests are not counted by the broker's Receive Maximum: beyond
    # max_pending the bridge answers "overloaded" at once
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix, max_pending=2)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    request = orjson.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [7]}]}
    )
    sent = time.monotonic()
    for i in range(5):
        c.publish(
            f"{prefix}/cam1/infer/slow",
            request,
            response_topic=f"{prefix}/replies",
            correlation=b"%d" % i,
            qos=0,
        )
    first = c.collect(3, timeout=SLOW_DELAY_S)  # the three beyond max_pending, at once
    assert time.monotonic() - sent < SLOW_DELAY_S
    for reply in first:
        assert reply.user["error-code"] == "UNAVAILABLE"
        assert "overloaded" in orjson.loads(reply.payload)["error"]
    rest = c.collect(2, timeout=SLOW_DELAY_S + 10)  # the two admitted ones, after the batch delay
    assert all(outputs(r)["OUTPUT0"]["data"] == [7.0] for r in rest)
    assert {r.correlation for r in first + rest} == {b"0", b"1", b"2", b"3", b"4"}
    m = mqtt_metrics(srv)
    assert m['dropped{reason="overloaded"}'] == 3 and m["answered"] == 2 and m["in_flight"] == 0


def test_shared_subscription_splits_the_load(run_appliance, broker, client, mqtt_repository):
    prefix = new_prefix()
    servers = [
        start(run_appliance, mqtt_repository, broker.port, device, prefix, shared_group="fleet")
        for device in ("dev-a", "dev-b")
    ]
    c = client(broker.port)
    for device in ("dev-a", "dev-b"):
        wait_online(c, prefix, device)
    c.subscribe(f"{prefix}/replies")
    count = 20
    for i in range(count):
        c.publish(
            f"{prefix}/infer/simple",  # the fleet topic: one member of the group takes each
            json_request(A, np.full((1, 16), i, np.int32)),
            response_topic=f"{prefix}/replies",
            correlation=b"%d" % i,
        )
    replies = c.collect(count)
    assert sorted(int(r.correlation or b"-1") for r in replies) == list(range(count))
    for r in replies:
        assert outputs(r)["OUTPUT0"]["data"] == (A + int(r.correlation or b"0")).ravel().tolist()
    by_device = {d: sum(r.user["device-id"] == d for r in replies) for d in ("dev-a", "dev-b")}
    assert by_device["dev-a"] > 0 and by_device["dev-b"] > 0, by_device
    answered = [mqtt_metrics(s)["answered"] for s in servers]
    assert answered == [by_device["dev-a"], by_device["dev-b"]]
    assert c.none_within(0.2) == []  # each request was answered by one device only


def test_broker_restart_mid_stream(run_appliance, make_broker, client, mqtt_repository):
    broker = make_broker(persistence=True)
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port, session=True)  # its session (and queued replies) survive too
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")

    def send(model: str, tag: str) -> None:
        request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
        payload = json_request(A, A) if model == "simple" else orjson.dumps(request)
        c.publish(
            f"{prefix}/cam1/infer/{model}",
            payload,
            response_topic=f"{prefix}/replies",
            correlation=tag.encode(),
        )

    for i in range(5):
        send("simple", f"before{i}")
    assert len(c.collect(5)) == 5
    for i in range(3):  # in flight at the bridge (unacknowledged) when the broker dies
        send("slow", f"slow{i}")
    wait_until(lambda: mqtt_metrics(srv)["in_flight"] == 3, what="three requests in flight")
    broker.stop()
    wait_until(lambda: mqtt_metrics(srv)["connected"] == 0, what="the bridge to notice")
    broker.start()  # same port, persistent sessions restored: the broker redelivers
    wait_until(
        lambda: mqtt_metrics(srv)["connected"] == 1, timeout=15, what="the bridge to reconnect"
    )
    wait_until(lambda: c.connected, timeout=15, what="the test client to reconnect")
    for i in range(5):
        send("simple", f"after{i}")
    replies = c.collect(8, timeout=SLOW_DELAY_S + 15, topic=f"{prefix}/replies")
    tags = sorted((r.correlation or b"").decode() for r in replies)
    assert tags == sorted([f"slow{i}" for i in range(3)] + [f"after{i}" for i in range(5)])
    assert [r for r in c.none_within(0.3) if r.topic == f"{prefix}/replies"] == []  # each once
    m = mqtt_metrics(srv)
    assert m["reconnects"] == 1 and m["answered"] == 13
    # the broker redelivered the three unacknowledged requests; none was inferred twice
    assert m["duplicates"] == 3 and m["received"] == 16
    stats = httpclient.InferenceServerClient(srv.url).get_inference_statistics("slow")
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 3

    # a broker that lost every session: the bridge subscribes again by itself
    broker.stop()
    broker.persistence = False
    (broker.workdir / "mosquitto.db").unlink()
    broker.start()
    wait_until(
        lambda: mqtt_metrics(srv)["reconnects"] == 2, timeout=15, what="the second reconnect"
    )
    wait_until(
        lambda: mqtt_metrics(srv)["connected"] == 1, timeout=15, what="the bridge to reconnect"
    )
    wait_until(lambda: c.connected, timeout=15, what="the test client to reconnect")
    wait_online(c, prefix, "cam1")  # "online" is published after the bridge subscribed
    c.subscribe(f"{prefix}/replies")  # the test client's own subscription went with the broker
    send("simple", "fresh")
    assert c.collect(1, topic=f"{prefix}/replies")[0].correlation == b"fresh"


def test_broker_down_at_start_does_not_touch_http(
    run_appliance, make_broker, client, mqtt_repository
):
    broker = make_broker(start=False)  # a port where nothing listens yet
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    http = httpclient.InferenceServerClient(srv.url)
    assert http.is_server_ready()
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(A)
    np.testing.assert_array_equal(http.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * A)
    assert mqtt_metrics(srv)["connected"] == 0
    broker.start()
    wait_until(lambda: mqtt_metrics(srv)["connected"] == 1, timeout=15, what="the late broker")
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    c.publish(
        f"{prefix}/cam1/infer/simple",
        json_request(A, A),
        response_topic=f"{prefix}/replies",
        correlation=b"late",
    )
    assert c.collect(1)[0].correlation == b"late"


def test_presence_retained_status_and_last_will(
    run_appliance, broker, client, mqtt_repository, tmp_path
):
    prefix = new_prefix()
    status = f"{prefix}/+/status"
    # graceful stop: the bridge says "offline" itself
    srv = start(run_appliance, mqtt_repository, broker.port, "cam-graceful", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam-graceful")
    srv.stop()
    late = client(broker.port)
    late.subscribe(status)
    reply = late.collect(1)[0]
    assert (reply.topic, reply.payload, reply.retain) == (
        f"{prefix}/cam-graceful/status",
        b"offline",
        True,
    )

    # killed: the broker publishes the Last Will; started through the CLI flag
    config = tmp_path / "appliance.yaml"
    config.write_text(f"mqtt:\n  device_id: cam-killed\n  topic_prefix: {prefix}\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance",
            "serve",
            "--config",
            str(config),
            "--model-repository",
            str(mqtt_repository),
            "--http-port",
            "-1",
            "--grpc-port",
            "-1",
            "--metrics-port",
            "-1",
            "--mqtt-broker",
            f"127.0.0.1:{broker.port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        watcher = client(broker.port)
        watcher.subscribe(f"{prefix}/cam-killed/status")
        seen = watcher.collect(1, timeout=30)[0]
        assert seen.payload == b"online"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    seen = watcher.collect(1, timeout=10)[0]
    assert seen.payload == b"offline"  # the will, published by the broker
    fresh = client(broker.port)
    fresh.subscribe(f"{prefix}/cam-killed/status")
    retained = fresh.collect(1)[0]
    assert (retained.payload, retained.retain) == (b"offline", True)


def test_a_broker_with_a_small_receive_maximum_is_respected(
    run_appliance, make_broker, client, mqtt_repository
):
    # mosquitto announces max_inflight_messages as its v5 Receive Maximum; the bridge's
    # default is 20 unacknowledged replies: it keeps to the broker's 4 on the connection
    # it has (a broker that saw a fifth would close it: no reconnect may be needed)
    broker = make_broker(extra=("max_inflight_messages 4",))
    prefix = new_prefix()
    srv = start(run_appliance, mqtt_repository, broker.port, "cam1", prefix)
    c = client(broker.port)
    wait_online(c, prefix, "cam1")
    c.subscribe(f"{prefix}/replies")
    for i in range(12):
        c.publish(
            f"{prefix}/cam1/infer/simple",
            json_request(A, A),
            response_topic=f"{prefix}/replies",
            correlation=b"%d" % i,
            wait=False,
        )
    assert len({r.correlation for r in c.collect(12)}) == 12
    m = mqtt_metrics(srv)
    assert m["reconnects"] == 0 and m["answered"] == 12 and m["connected"] == 1


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_tls_with_a_client_certificate(
    run_appliance, make_broker, client, mqtt_repository, tmp_path
):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    certs = tmp_path / "certs"
    certs.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=certs)  # fmt: skip
    (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=certs)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
                 "-out", f"{name}.pem", cwd=certs)  # fmt: skip
    tls_port = free_port()
    broker = make_broker(
        extra=(
            f"listener {tls_port} 127.0.0.1",  # the plain listener stays for the test client
            f"cafile {certs / 'ca.pem'}",
            f"certfile {certs / 'server.pem'}",
            f"keyfile {certs / 'server.key'}",
            "require_certificate true",
        )
    )
    prefix = new_prefix()
    tls = {
        k: str(certs / f)
        for k, f in (("ca_file", "ca.pem"), ("cert_file", "client.pem"), ("key_file", "client.key"))
    }
    srv = start(run_appliance, mqtt_repository, tls_port, "cam-tls", prefix, tls=tls)
    c = client(broker.port)
    wait_online(c, prefix, "cam-tls")
    c.subscribe(f"{prefix}/replies")
    c.publish(
        f"{prefix}/cam-tls/infer/simple",
        json_request(A, A),
        response_topic=f"{prefix}/replies",
        correlation=b"tls",
    )
    reply = c.collect(1)[0]
    assert (
        reply.correlation == b"tls"
        and outputs(reply)["OUTPUT0"]["data"] == (2 * A).ravel().tolist()
    )
    assert mqtt_metrics(srv)["connected"] == 1


def test_the_documented_paho_example_prints_its_reply(
    run_appliance, broker, client, mqtt_repository
):
    """docs/mqtt.md's paho example as written (its broker's address put in), in a process
    of its own: it waits for the reply and prints it."""
    (example,) = examples("mqtt.md", "test_the_documented_paho_example_prints_its_reply")
    start(run_appliance, mqtt_repository, broker.port, "cam-gate-3", "site-a/appliance")
    wait_online(client(broker.port), "site-a/appliance", "cam-gate-3")
    code = example.replace('connect("192.168.1.10", 1883)', f'connect("127.0.0.1", {broker.port})')
    assert code != example
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    correlation, reply = done.stdout.split(" ", 1)
    assert len(bytes.fromhex(correlation)) == 16  # the request's uuid
    doc = ast.literal_eval(reply)  # the printed dict (print shows Python's form of the JSON)
    out = {o["name"]: o["data"] for o in doc["outputs"]}
    assert out["OUTPUT0"] == list(range(1, 17)) and out["OUTPUT1"] == list(range(-1, 15))
