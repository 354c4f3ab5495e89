"""The MQTT bridge through hard broker outages, against a real mosquitto.

mosquitto runs with persistence as a device's broker would (saved every second, not
on each change) and is killed with SIGKILL several times in a row while a producer
publishes QoS 1 requests. What the bridge owns must hold: every request is inferred
and answered exactly once (a redelivery is recognised by its correlation data), the
bridge is back soon after the broker (the reconnect backoff is capped), and every
request gets its reply. Each kill comes after the broker has saved the sessions:
what a broker loses from memory in a power cut between two saves is the broker's
loss, not the bridge's (docs/mqtt.md).

Also here: the CONNECT the bridge sends announces ``max_pending`` as its Receive
Maximum (read off the wire by a listening socket standing in for a broker).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import tritonclient.http as httpclient
from mosquitto import Broker, Client, Reply, mqtt_metrics, require_mosquitto, wait_until

from devtools import modelgen

A = np.arange(16, dtype=np.int32).reshape(1, 16)
KILLS = 3
RATE_S = 0.04  # a request every 40 ms: ~25 a second, as a camera would


def _request(i: int) -> bytes:
    pairs = (("INPUT0", A), ("INPUT1", np.full((1, 16), i, np.int32)))
    inputs = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": x.ravel().tolist()}
        for n, x in pairs
    ]
    return orjson.dumps({"inputs": inputs})


def _saved(broker: Broker, after: int) -> None:
    wait_until(lambda: broker.saves() > after, timeout=15, what="the broker to save its state")


def test_sigkilled_broker_loses_no_request_and_answers_each_once(
    run_appliance: Any, tmp_path: Path
) -> None:
    binary = require_mosquitto()
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    (tmp_path / "broker").mkdir()
    broker = Broker(binary, tmp_path / "broker", persistence=True, extra=("autosave_interval 1",))
    broker.start()
    prefix = "outage"
    producer: Client | None = None
    try:
        # the bridge's own reconnect backoff (defaults): capped at 2 s
        mqtt = {"host": "127.0.0.1", "port": broker.port, "device_id": "cam"}
        srv = run_appliance(repo, mqtt=dict(mqtt, topic_prefix=prefix, keepalive_s=5))
        producer = Client(broker.port, session=True)
        wait_until(lambda: mqtt_metrics(srv)["connected"] == 1, what="the bridge to connect")
        producer.subscribe(f"{prefix}/replies")
        _saved(broker, broker.saves())
        sent: list[int] = []
        stop = threading.Event()

        def produce() -> None:
            assert producer is not None
            while not stop.is_set() and len(sent) < 2000:  # bounded
                i = len(sent)
                producer.publish(
                    f"{prefix}/cam/infer/simple",
                    _request(i),
                    response_topic=f"{prefix}/replies",
                    correlation=b"%d" % i,
                    wait=False,  # paho keeps it while the broker is down
                )
                sent.append(i)
                time.sleep(RATE_S)

        thread = threading.Thread(target=produce, name="producer")
        thread.start()
        try:
            for _ in range(KILLS):
                time.sleep(0.5)
                broker.kill()
                time.sleep(0.5)
                saves = broker.saves()
                broker.start()
                wait_until(
                    lambda: mqtt_metrics(srv)["connected"] == 1, timeout=20, what="the bridge"
                )
                wait_until(lambda: producer.connected, timeout=20, what="the producer")
                _saved(broker, saves)  # the next kill loses nothing the two sides own
        finally:
            stop.set()
            thread.join(30)
        replies: Counter[bytes] = Counter()
        redelivered: list[Reply] = []
        end = time.monotonic() + 30  # bounded wait for the last replies
        while len(replies) < len(sent) and time.monotonic() < end:
            for reply in producer.collect(1, timeout=max(0.1, end - time.monotonic())):
                replies[reply.correlation or b""] += 1
                if reply.dup:
                    redelivered.append(reply)
        missing = [i for i in sent if b"%d" % i not in replies]
        assert not missing, f"{len(missing)} of {len(sent)} requests got no reply: {missing}"
        # extra copies only where the broker itself sent a reply again after its restart
        extra = sum(n - 1 for n in replies.values())
        assert extra <= len(redelivered), (extra, replies.most_common(3))
        m = mqtt_metrics(srv)
        assert m["reconnects"] == KILLS
        assert m["answered"] == len(sent) and m["errors"] == 0  # each inferred and answered once
        stats = httpclient.InferenceServerClient(srv.url).get_inference_statistics("simple")
        assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == len(sent)
    finally:
        if producer is not None:
            producer.close()
        broker.stop()


def _connect_packet(port_holder: list[int], packets: list[bytes]) -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_holder.append(listener.getsockname()[1])

    def accept() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while len(data) < 2 or len(data) < _packet_length(data):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            packets.append(data)

    threading.Thread(target=accept, daemon=True).start()
    return listener


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _packet_length(data: bytes) -> int:
    try:
        length, at = _varint(data, 1)
    except IndexError:
        return len(data) + 1
    return at + length


def _receive_maximum(connect: bytes) -> int | None:
    """The Receive Maximum property (0x21) of an MQTT v5 CONNECT packet."""
    assert connect[0] == 0x10, "not a CONNECT"
    _, at = _varint(connect, 1)
    name_length = int.from_bytes(connect[at : at + 2], "big")
    at += 2 + name_length
    assert connect[at] == 5, "not MQTT v5"
    at += 1 + 1 + 2  # level, flags, keep alive
    length, at = _varint(connect, at)
    end = at + length
    while at < end:  # the CONNECT properties, as MQTT v5 section 3.1.2.11 lists them
        prop = connect[at]
        at += 1
        if prop == 0x21:
            return int.from_bytes(connect[at : at + 2], "big")
        if prop == 0x11 or prop == 0x27:  # four-byte integers
            at += 4
        elif prop == 0x22:  # two-byte integer
            at += 2
        elif prop in (0x17, 0x19):  # bytes
            at += 1
        elif prop in (0x15, 0x16):  # string / binary data
            at += 2 + int.from_bytes(connect[at : at + 2], "big")
        elif prop == 0x26:  # user property: two strings
            for _ in range(2):
                at += 2 + int.from_bytes(connect[at : at + 2], "big")
        else:
            raise AssertionError(f"unexpected CONNECT property {prop:#x}")
    return None


def test_connect_announces_max_pending_as_receive_maximum(
    run_appliance: Any, tmp_path: Path
) -> None:
    port: list[int] = []
    packets: list[bytes] = []
    listener = _connect_packet(port, packets)
    try:
        repo = tmp_path / "repo"
        modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
        mqtt = {"host": "127.0.0.1", "port": port[0], "device_id": "cam", "max_pending": 7}
        run_appliance(repo, mqtt=mqtt)
        wait_until(lambda: packets, what="the bridge's CONNECT")
        assert _receive_maximum(packets[0]) == 7
    finally:
        listener.close()
