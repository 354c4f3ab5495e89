"""Hostile MQTT producers against a real mosquitto that requires credentials, with the
appliance's bridge behind it, and the bridge's own refusal past the queued-bytes limit.

MQTT's token is the broker's: the bridge serves whatever the broker lets a client
publish on its request topics, so the broker authenticates (``password_file``) and
authorizes (``acl_file``) each producer. A producer with no credentials or a wrong
password is refused at CONNECT and nothing reaches the bridge; a producer the broker
lets in, past ``max_queued_bytes``, gets an UNAVAILABLE reply sized by its payload,
before the payload is decoded. Each test asserts what was answered or refused, that
the bridge counted nothing it should not have, and that a legitimate request is
served after; RSS is not measured here (the payloads are bounded by the broker's
Maximum Packet Size, which the bridge announces from ``max_request_size``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import paho.mqtt.client as mqtt
import pytest
from mosquitto import Broker, Client, mqtt_metrics, require_mosquitto, wait_until
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from devtools import modelgen

PREFIX = "refusal"
DEVICE = "cam1"
SLOW = """\
max_batch_size: 8
input:
  - {name: INPUT0, data_type: TYPE_FP32, dims: [-1]}
output:
  - {name: OUTPUT0, data_type: TYPE_FP32, dims: [-1]}
dynamic_batching: {preferred_batch_size: [8], max_queue_delay_microseconds: 2000000}
"""
USERS = {"appliance": "appliance-pw", "producer": "producer-pw"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("refusal_repo")
    modelgen.write_model(path, "slow", modelgen.identity("FP32", [-1]), SLOW)
    return path


@pytest.fixture
def locked_broker(tmp_path: Path) -> Iterator[Broker]:
    """A mosquitto that lets in only the two users, each on its own topics."""
    binary = require_mosquitto()
    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(USERS.items()):
        flags = ["-b"] + (["-c"] if i == 0 else [])
        subprocess.run(["mosquitto_passwd", *flags, str(passwd), user, password], check=True)
    acl = tmp_path / "acl"
    acl.write_text(
        "user appliance\ntopic readwrite #\n\n"
        f"user producer\ntopic write {PREFIX}/{DEVICE}/infer/#\ntopic read {PREFIX}/replies\n"
        "topic readwrite test/ping/#\n",  # the test client's round trips (Client.ping)
        encoding="utf-8",
    )
    broker = Broker(
        binary,
        tmp_path,
        extra=("allow_anonymous false", f"password_file {passwd}", f"acl_file {acl}"),
    )
    broker.start()
    yield broker
    broker.stop()


def _serve(run_appliance: Any, repo: Path, port: int, **server: Any) -> Any:
    mqtt_options = {
        "host": "127.0.0.1",
        "port": port,
        "device_id": DEVICE,
        "topic_prefix": PREFIX,
        "username": "appliance",
        "password": USERS["appliance"],
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.5,
    }
    srv = run_appliance(repo, mqtt=mqtt_options, **server)
    wait_until(lambda: mqtt_metrics(srv)["connected"] == 1, 15, "the bridge to connect")
    return srv


def _producer(port: int) -> Client:
    """The test client, logged in as the producer."""
    c = Client(port, login=("producer", USERS["producer"]))
    c.subscribe(f"{PREFIX}/replies")
    return c


def _request(values: np.ndarray) -> bytes:
    return orjson.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, values.size],
                    "data": values.tolist(),
                }
            ]
        }
    )


def _connect_as(port: int, user: str | None, password: str | None) -> int:
    """A CONNECT as ``user`` (None: no credentials): the broker's reason code."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
    if user is not None:
        c.username_pw_set(user, password)
    codes: list[int] = []
    c.on_connect = lambda client, userdata, flags, reason, props: codes.append(reason.value)
    c.connect("127.0.0.1", port, keepalive=10)
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        c.loop(0.1)
    c.disconnect()
    assert codes, "the broker did not answer the CONNECT"
    return codes[0]


@pytest.mark.parametrize(
    "user,password", [(None, None), ("producer", "wrong")], ids=["no credentials", "wrong password"]
)
def test_a_producer_without_credentials_never_reaches_the_bridge(
    run_appliance: Any, repo: Path, locked_broker: Broker, user: str | None, password: str | None
) -> None:
    srv = _serve(run_appliance, repo, locked_broker.port)
    code = _connect_as(locked_broker.port, user, password)
    assert code in (0x86, 0x87), hex(code)  # bad user name or password / not authorized
    assert mqtt_metrics(srv)["received"] == 0
    c = _producer(locked_broker.port)  # the producer the broker lets in is served
    c.publish(
        f"{PREFIX}/{DEVICE}/infer/slow",
        _request(np.ones(4, np.float32)),
        response_topic=f"{PREFIX}/replies",
    )
    (reply,) = c.collect(1, timeout=30)
    assert orjson.loads(reply.payload)["outputs"][0]["data"] == [1.0] * 4
    c.close()


def test_a_payload_past_the_queued_bytes_limit_is_refused_before_it_is_decoded(
    run_appliance: Any, repo: Path, locked_broker: Broker
) -> None:
    """A request waits in ``slow``'s batch delay holding its bytes; a second one whose
    payload does not fit beside it under ``max_queued_bytes`` is answered UNAVAILABLE
    at once, from its size: not INVALID_ARGUMENT for the input it names wrongly, which
    only decoding it would find; once the first is answered (and its
    reply published) nothing is held and the next request is served."""
    srv = _serve(run_appliance, repo, locked_broker.port, max_queued_bytes="64KiB")
    c = _producer(locked_broker.port)
    big = _request(np.arange(20000, dtype=np.float32))  # 80 KB of tensor, ~130 KB of JSON
    topic = f"{PREFIX}/{DEVICE}/infer/slow"
    c.publish(topic, big, response_topic=f"{PREFIX}/replies", correlation=b"first")
    wait_until(lambda: srv.server.dataplane.queued.held > 0, 15, "the first request held")
    # the second names an input the model lacks: decoded, it would be INVALID_ARGUMENT
    unread = big.replace(b'"INPUT0"', b'"NO_SUCH_INPUT"')
    c.publish(topic, unread, response_topic=f"{PREFIX}/replies", correlation=b"second")
    refused = c.collect(1, timeout=30)[0]
    assert refused.correlation == b"second"
    assert refused.user["error-code"] == "UNAVAILABLE"
    assert "max_queued_bytes" in orjson.loads(refused.payload)["error"]
    answered = c.collect(1, timeout=30)[0]
    assert answered.correlation == b"first"
    assert len(orjson.loads(answered.payload)["outputs"][0]["data"]) == 20000
    wait_until(lambda: srv.server.dataplane.queued.held == 0, 15, "the holds given back")
    c.publish(topic, _request(np.ones(2, np.float32)), response_topic=f"{PREFIX}/replies")
    assert orjson.loads(c.collect(1, timeout=30)[0].payload)["outputs"][0]["data"] == [1.0, 1.0]
    c.close()
