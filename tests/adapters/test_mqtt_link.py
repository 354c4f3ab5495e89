"""The MQTT bridge's connection layer without a broker: the socket paho reads and
writes through (over a real socket pair), and the reply properties packed in
advance, checked against paho's own packing and parsing."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from appliance.adapters.mqtt.client import PackedProperties, reply_properties
from appliance.adapters.mqtt.protocol import HEADER_LENGTH, Inbound
from appliance.adapters.mqtt.socket import BufferedSocket


@pytest.fixture
def pair() -> Iterator[tuple[BufferedSocket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    yield BufferedSocket(ours), theirs
    ours.close()
    theirs.close()


def test_paho_reads_only_what_was_handed_in_order(
    pair: tuple[BufferedSocket, socket.socket],
) -> None:
    sock, peer = pair
    peer.sendall(b"\x30\x05hello\x40\x02\x00\x01")
    assert sock.read() == b"\x30\x05hello\x40\x02\x00\x01"  # the driver's one read
    with pytest.raises(BlockingIOError):  # nothing handed yet: paho "would block"
        sock.recv(1)
    sock.hand(0x40, b"\x00\x01")  # a PUBACK, re-framed whole for paho
    sock.hand(0x90, b"\x00\x01\x00")  # a SUBACK behind it
    assert sock.recv(1) == b"\x40"  # paho: the packet type
    assert sock.recv(1) == b"\x02"  # the remaining length
    assert sock.recv(2) == b"\x00\x01"  # paho asks for the rest of its packet
    assert sock.recv(100) == b"\x90\x03\x00\x01\x00"  # never more than was handed
    assert sock.pending() == 0  # a plain socket: nothing hidden from the selector
    with pytest.raises(BlockingIOError):  # nothing left: as the socket itself says
        sock.recv(1)
    big = b"x" * 200_000
    sock.hand(0x30, big)  # a length of three bytes
    assert sock.recv(4) == b"\x30\xc0\x9a\x0c" and sock.recv(200_000) == big
    sock.hand(0xD0, b"")  # a PINGRESP handed before the end is read before it
    sock.end(None)  # the driver read b"": the broker closed
    assert sock.recv(2) == b"\xd0\x00"
    assert sock.recv(1) == b""  # paho sees the end and closes
    sock.end(ConnectionResetError("reset"))
    with pytest.raises(ConnectionResetError):  # or the error the driver met
        sock.recv(1)
    peer.close()
    assert sock.read() == b""


def test_gathered_writes_go_out_as_one_in_order(
    pair: tuple[BufferedSocket, socket.socket],
) -> None:
    sock, peer = pair
    assert sock.send(b"direct") == 6  # outside a gather: straight to the kernel
    assert peer.recv(100) == b"direct"
    sock.gather()
    assert sock.send(b"reply") == 5 and sock.send(bytearray(b"+ack")) == 4
    assert sock.flush() is False  # all taken by the kernel
    assert peer.recv(100) == b"reply+ack"
    # a kernel buffer that fills: the rest waits, ahead of later writes
    sock.gather()
    big = bytes(range(256)) * 40_000
    sock.send(big)
    assert sock.flush() is True and sock.backlog
    sock.send(b"after")  # queued behind what the kernel has not taken
    received = bytearray()
    while sock.backlog or len(received) < len(big) + 5:
        received += peer.recv(1 << 20)
        if sock.backlog:
            sock.flush()
    assert bytes(received) == big + b"after"


def test_close_sends_what_was_gathered(pair: tuple[BufferedSocket, socket.socket]) -> None:
    sock, peer = pair
    sock.gather()
    sock.send(b"\xe0\x00")  # a DISCONNECT, written last before paho closes
    sock.close()
    assert peer.recv(10) == b"\xe0\x00"
    assert peer.recv(10) == b""


@pytest.mark.parametrize("correlation", [None, b"", b"c7", bytes(range(256)) * 3])
@pytest.mark.parametrize("code", ["", "UNAVAILABLE"])
def test_packed_reply_properties_match_paho(correlation: bytes | None, code: str) -> None:
    msg = Inbound("p/cam/infer/m", b"", correlation=correlation)
    packed = reply_properties(msg, "cam \u2713", "application/octet-stream", 1234, code)
    assert isinstance(packed, PackedProperties)
    expected = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if correlation is not None:
        expected.CorrelationData = correlation
    expected.ContentType = "application/octet-stream"
    user = [("device-id", "cam \u2713"), (HEADER_LENGTH, "1234")]
    expected.UserProperty = user + ([("error-code", code)] if code else [])
    assert packed.pack() == expected.pack()  # type: ignore[no-untyped-call]
    parsed = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    parsed.unpack(packed.pack())  # type: ignore[no-untyped-call]
    assert getattr(parsed, "CorrelationData", None) == correlation
    assert getattr(packed, "UserProperty") == getattr(parsed, "UserProperty")  # noqa: B009
    assert "device-id" in str(packed)  # paho's debug log shows them


def test_packed_properties_refuse_a_value_over_the_protocol_limit() -> None:
    with pytest.raises(ValueError, match="over 65535"):
        PackedProperties(b"x" * 70_000, "application/json", [])
