"""The MQTT bridge against packets it must refuse, on real sockets.

- A hostile broker (a few lines of MQTT v5 on a loopback socket in this process)
  accepts the bridge, then sends it a malformed, oversized or forbidden PUBLISH: the
  bridge answers with the DISCONNECT reason code MQTT v5 prescribes, counts the
  refusal, reconnects and serves the next request; its event loop never stalls (the
  appliance fixture's blocking detector watches it).
- Producers that send malformed packets to the real mosquitto are cut off by the
  broker; the bridge behind it never notices and goes on serving.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from mosquitto import Broker, Client, mqtt_metrics, require_mosquitto, wait_until
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from appliance.adapters.mqtt.packets import (
    MALFORMED,
    PACKET_HEADROOM,
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    TOPIC_ALIAS_INVALID,
    encode_varint,
)
from devtools import modelgen

PREFIX = "hostile"
REQUEST_LIMIT = 2**20  # the server's max_request_size here: packets up to 2 MiB
REQUEST = orjson.dumps(
    {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
            for n in ("INPUT0", "INPUT1")
        ]
    }
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile_repo")
    modelgen.write_model(path, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    return path


def options(port: int, prefix: str = PREFIX) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "port": port,
        "device_id": "cam1",
        "topic_prefix": prefix,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.5,
        "keepalive_s": 5,
        "session_expiry_s": 60,
    }


def text(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return len(raw).to_bytes(2, "big") + raw


def packet(header: int, body: bytes) -> bytes:
    return bytes((header,)) + encode_varint(len(body)) + body


def request_body(props: bytes, topic: str = f"{PREFIX}/cam1/infer/simple") -> bytes:
    """A request PUBLISH's body, packet id 1; ``props`` with their length first."""
    return text(topic) + b"\x00\x01" + props + REQUEST


def request(props: bytes, topic: str = f"{PREFIX}/cam1/infer/simple") -> bytes:
    return packet(0x32, request_body(props, topic))


def read_packet(sock: socket.socket) -> tuple[int, bytes] | None:
    """One packet (first byte, body), or None when the peer closed."""

    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    first = exactly(1)
    if first is None:
        return None
    length, shift = 0, 0
    while True:
        byte = exactly(1)
        if byte is None:
            return None
        length |= (byte[0] & 0x7F) << shift
        shift += 7
        if byte[0] < 0x80:
            break
    body = exactly(length)
    return None if body is None else (first[0], body)


class HostileBroker:
    """Accepts the bridge (CONNACK, SUBACK, PUBACKs), sends ``attack`` on the first
    connection and records what the bridge answered; on the second it sends one good
    request and records the reply."""

    def __init__(self, attack: bytes) -> None:
        self.attack = attack
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(20)
        self.port = self.listener.getsockname()[1]
        self.connect_props: Properties | None = None
        self.disconnect: bytes | None = None  # the DISCONNECT body of the first connection
        self.reply: tuple[str, Properties] | None = None
        self.acked: list[int] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for n in range(2):
                conn, _ = self.listener.accept()
                with conn:
                    conn.settimeout(20)
                    self._serve(conn, first=n == 0)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            self.listener.close()

    def _serve(self, conn: socket.socket, first: bool) -> None:
        connect = read_packet(conn)
        assert connect is not None and connect[0] == 0x10
        body = connect[1]
        at = 2 + int.from_bytes(body[:2], "big") + 4  # name, level, flags, keep-alive
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.unpack(body[at:])  # type: ignore[no-untyped-call]
        self.connect_props = props
        conn.sendall(b"\x20\x03\x00\x00\x00")  # CONNACK: new session, success
        attacked = False
        while (got := read_packet(conn)) is not None:
            header, body = got
            kind = header >> 4
            if kind == 8:  # SUBSCRIBE: grant QoS 1 to each filter
                at, filters = 3, 0  # after the packet id and an empty property section
                while at < len(body):
                    at += 2 + int.from_bytes(body[at : at + 2], "big") + 1  # filter, options
                    filters += 1
                conn.sendall(packet(0x90, body[:2] + b"\x00" + b"\x01" * filters))
            elif kind == 3:
                topic_len = int.from_bytes(body[:2], "big")
                topic = body[2 : 2 + topic_len].decode()
                qos = (header >> 1) & 3
                if qos:
                    mid = body[2 + topic_len : 4 + topic_len]
                    conn.sendall(b"\x40\x02" + mid)
                rest = body[2 + topic_len + (2 if qos else 0) :]
                props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
                props.unpack(rest)  # type: ignore[no-untyped-call]
                if topic.endswith("/status") and not attacked:
                    attacked = True  # online: subscribed, the attack or the request now
                    conn.sendall(self.attack if first else request(GOOD_PROPS))
                elif topic == "r":
                    self.reply = (topic, props)
            elif kind == 4:  # the bridge's PUBACK of our request
                self.acked.append(int.from_bytes(body[:2], "big"))
            elif kind == 14:  # DISCONNECT
                if first:
                    self.disconnect = body
                return


# the good request's properties, with the response topic "r": (length, response topic,
# correlation data); the attacks are whole packets
GOOD_PROPS = b"\x09\x08\x00\x01r\x09\x00\x02ok"
ATTACKS = {
    # the property length says 12 bytes; the packet ends after 2
    "malformed": (
        packet(0x32, text(f"{PREFIX}/cam1/infer/simple") + b"\x00\x01\x0c\x01"),
        MALFORMED,
    ),
    # 3 MiB announced, over the 2 MiB the CONNECT allowed: refused before the body
    "too_large": (b"\x30" + encode_varint(3 * 2**20) + b"x" * 64, PACKET_TOO_LARGE),
    "topic_alias": (request(b"\x03\x23\x00\x01"), TOPIC_ALIAS_INVALID),
    "qos2": (packet(0x34, request_body(b"\x00")), PROTOCOL_ERROR),
    "puback_flags": (b"\x42\x02\x00\x01", MALFORMED),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_broker_is_refused_and_the_bridge_goes_on(
    run_appliance: Any, repo: Path, attack: str
) -> None:
    bad, reason = ATTACKS[attack]
    hostile = HostileBroker(bad)
    srv = run_appliance(repo, mqtt=options(hostile.port), max_request_size="1MiB")
    wait_until(lambda: hostile.reply is not None or hostile.errors, 30, "the second request")
    assert not hostile.errors, hostile.errors
    assert hostile.disconnect is not None and hostile.disconnect[:1] == bytes((reason,))
    props = hostile.connect_props
    assert (
        props is not None
        and getattr(props, "MaximumPacketSize", None) == REQUEST_LIMIT + PACKET_HEADROOM
    )
    assert hostile.reply is not None and getattr(hostile.reply[1], "CorrelationData", None) == b"ok"
    wait_until(lambda: hostile.acked == [1], 10, "the request's PUBACK")
    m = mqtt_metrics(srv)
    assert m['dropped{reason="malformed"}'] == 1
    assert m["answered"] == 1 and m["reconnects"] == 1 and m["connected"] == 1


# ---- malformed producers through the real mosquitto ----------------------------------------


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    binary = require_mosquitto()
    b = Broker(binary, tmp_path_factory.mktemp("mosquitto_hostile"))
    b.start()
    yield b
    b.stop()


def raw_producer(port: int, name: str) -> socket.socket:
    """A producer speaking MQTT v5 by hand, connected (CONNACK read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = text("MQTT") + b"\x05\x02\x00\x3c\x00" + text(name)  # clean start, 60 s
    sock.sendall(packet(0x10, body))
    got = read_packet(sock)
    assert got is not None and got[0] == 0x20 and got[1][1] == 0, got
    return sock


@pytest.mark.parametrize(
    "props",
    [
        b"\x0b\x26\x00\x01k\x00\x04v\xff\xfe!",  # a user property value that is not UTF-8
        b"\x0c\x26\x00\x01k\x00\x01v",  # the property length past the properties
        b"\x05\x08\x00\x02\x00r",  # a response topic holding U+0000
    ],
)
def test_malformed_producers_are_cut_off_by_mosquitto_not_the_bridge(
    run_appliance: Any, repo: Path, broker: Broker, props: bytes
) -> None:
    prefix = f"hostile{os.getpid()}/{props.hex()}"
    srv = run_appliance(repo, mqtt=options(broker.port, prefix))
    good = Client(broker.port)
    try:
        good.subscribe(f"{prefix}/cam1/status", f"{prefix}/replies")
        wait_until(lambda: mqtt_metrics(srv)["connected"] == 1, 15, "the bridge online")
        bad = raw_producer(broker.port, f"bad-{os.getpid()}")
        with bad:
            bad.sendall(request(props, f"{prefix}/cam1/infer/simple"))
            while (got := read_packet(bad)) is not None:  # a DISCONNECT, then the end
                assert got[0] == 0xE0, got
        good.publish(
            f"{prefix}/cam1/infer/simple",
            REQUEST,
            response_topic=f"{prefix}/replies",
            correlation=b"after",
        )
        reply = good.collect(1, topic=f"{prefix}/replies")[0]
        assert reply.correlation == b"after" and "error" not in orjson.loads(reply.payload)
        m = mqtt_metrics(srv)
        assert m["received"] == 1 and m["answered"] == 1
        assert m['dropped{reason="malformed"}'] == 0 and m["reconnects"] == 0
    finally:
        good.close()
