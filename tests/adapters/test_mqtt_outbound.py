"""The bridge's own publishes without a broker: the packets it writes decode as MQTT
v5 PUBLISH packets (through paho's decoder and the bridge's), and what a QoS 1 sender
owes the broker holds (the Receive Maximum, unique packet ids, order, a resend with
DUP after a reconnect, a bounded queue)."""

from __future__ import annotations

import asyncio

import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion

from appliance.adapters.mqtt.client import reply_properties
from appliance.adapters.mqtt.outbound import Outbound
from appliance.adapters.mqtt.packets import (
    Framer,
    decode_puback,
    decode_publish,
    encode_puback,
    encode_publish,
)
from appliance.adapters.mqtt.protocol import Inbound


def parse(packet: bytes) -> tuple[int, Inbound]:
    framer = Framer(2**30)
    framer.feed(packet)
    got = framer.next()
    assert got is not None and framer.pending() == 0
    return got[0], decode_publish(*got)


def test_a_reply_decodes_the_same_through_paho_and_the_bridge() -> None:
    props = reply_properties(Inbound("t", b"", correlation=b"c1"), "cam", "application/json", 7, "")
    wire = encode_publish("p/replies/\u00e9", b"{}", 1, 513, props.pack(), retain=True)  # type: ignore[no-untyped-call]
    header, msg = parse(wire)
    assert header == 0x33 and msg.mid == 513 and msg.topic == "p/replies/\u00e9"
    assert msg.correlation == b"c1" and msg.payload == b"{}"
    assert msg.user_properties == {"device-id": "cam", "Inference-Header-Content-Length": "7"}
    theirs = _packet.decode_publish(header, wire[2:], MQTTProtocolVersion.MQTTv5)
    assert theirs.topic == "p/replies/\u00e9".encode() and theirs.mid == 513
    assert theirs.retain and theirs.payload == b"{}"
    assert getattr(theirs.properties, "CorrelationData", None) == b"c1"
    assert decode_puback(0x40, encode_puback(513)[2:]) == (513, 0)
    assert decode_puback(0x40, b"\x02\x01\x87\x00") == (513, 0x87)


@pytest.mark.parametrize("topic", ["", "a/+", "a/#", "a/\x00", "x" * 70_000])
def test_a_topic_no_publish_may_name_is_refused(topic: str) -> None:
    with pytest.raises(ValueError, match="not a topic"):
        encode_publish(topic, b"", 0, 0, b"\x00")


def test_the_window_ids_order_resend_and_queue_limit() -> None:
    sent: list[bytes] = []
    out = Outbound(sent.append, queue_limit=3, cap=20)
    assert out.publish("t/early", b"q", 1)  # before any connection: queued
    assert not out.publish("t/zero", b"", 0)  # QoS 0 while detached: dropped
    assert sent == []
    out.attach(receive_maximum=2)  # the broker's Receive Maximum is under our cap
    for i in range(4):
        assert out.publish(f"t/{i}", b"", 1)
    assert not out.publish("t/over", b"", 1)  # 2 in flight, 3 queued: full
    assert [parse(p)[1].topic for p in sent] == ["t/early", "t/0"]
    mids = [parse(p)[1].mid for p in sent]
    assert len(set(mids)) == 2 and out.unacknowledged == 2 and out.queued == 3
    assert not out.acknowledged(999, 0)  # not ours: ignored
    assert out.acknowledged(mids[0], 0)  # room for the next, in order, with a fresh id
    assert parse(sent[-1])[1].topic == "t/1" and parse(sent[-1])[1].mid not in mids[1:]
    out.detach()
    sent.clear()
    out.attach(receive_maximum=1)  # a smaller window after the reconnect
    header, first = parse(sent[0])
    assert len(sent) == 1 and header & 0x08 and first.topic == "t/0"  # DUP, oldest first
    assert out.acknowledged(first.mid, 0)
    header, second = parse(sent[1])
    assert second.topic == "t/1" and header & 0x08 == 0  # sent again under a new id
    assert out.unacknowledged == 1


def test_the_ids_wrap_and_skip_those_in_flight() -> None:
    sent: list[bytes] = []
    out = Outbound(sent.append, queue_limit=10, cap=3)
    out.attach(3)
    out.publish("t/a", b"", 1)  # id 1 stays in flight throughout
    for _ in range(70_000):
        out.publish("t/b", b"", 1)
        assert out.acknowledged(parse(sent[-1])[1].mid, 0)
    assert parse(sent[0])[1].mid == 1
    assert all(parse(p)[1].mid != 1 for p in sent[1:])  # never reused while unacknowledged


def test_one_allocator_for_paho_subscribe_and_our_publishes() -> None:
    """MQTT v5 2.2.1: a SUBSCRIBE (paho's, with ids from Outbound.take_id as the bridge
    wires it) and our QoS 1 PUBLISH packets in flight never share a packet id."""
    sent: list[bytes] = []
    out = Outbound(sent.append, queue_limit=10, cap=5)
    out.attach(5)
    out.publish("t/a", b"", 1)
    out.publish("t/a", b"", 1)
    subscribe = out.take_id()  # paho's next SUBSCRIBE
    for _ in range(3):
        out.publish("t/b", b"", 1)
    ours = [parse(p)[1].mid for p in sent]
    assert subscribe not in ours and len(set(ours)) == 5
    for mid in ours:
        assert out.acknowledged(mid, 0)
    for _ in range(70_000):  # around the id space: the SUBSCRIBE's id stays taken
        out.publish("t/c", b"", 1)
        mid = parse(sent[-1])[1].mid
        assert mid != subscribe
        assert out.acknowledged(mid, 0)
    out.release_id(subscribe)  # its SUBACK came
    out.detach()
    out.attach(5)
    assert out.take_id() not in {parse(p)[1].mid for p in sent[-1:]}


def test_done_gets_the_pubacks_reason() -> None:
    async def main() -> int:
        sent: list[bytes] = []
        out = Outbound(sent.append, queue_limit=1)
        out.attach(65535)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        out.publish("s", b"offline", 1, retain=True, done=done)
        out.acknowledged(parse(sent[0])[1].mid, 0x10)  # no matching subscribers
        return await asyncio.wait_for(done, 5)

    assert asyncio.run(main()) == 0x10
