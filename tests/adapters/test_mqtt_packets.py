"""The bridge's own reading of incoming MQTT v5 packets, without a broker: whole
PUBLISH packets built by paho's encoder decode to the same fields, the stream is cut
into packets however it arrives, and every length check and every rule of MQTT v5
the decoder enforces refuses with the reason code the specification prescribes.
(A hostile broker on a real socket, and malformed producers through the real
mosquitto, are in test_mqtt_hostile.py.)"""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from appliance.adapters.mqtt.packets import (
    MALFORMED,
    PACKET_HEADROOM,
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    TOPIC_ALIAS_INVALID,
    TOPIC_NAME_INVALID,
    Framer,
    PacketError,
    decode_publish,
    encode_varint,
    packet_limit,
)
from appliance.adapters.mqtt.socket import BufferedSocket

TOPIC = "p/cam1/infer/simple"


def text(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return len(raw).to_bytes(2, "big") + raw


def publish(
    props: bytes = b"", topic: bytes | str = TOPIC, mid: int | None = 7, payload: bytes = b"xy"
) -> bytes:
    """A PUBLISH body: topic, packet id (None: QoS 0), properties, payload."""
    ident = b"" if mid is None else mid.to_bytes(2, "big")
    return text(topic) + ident + encode_varint(len(props)) + props + payload


def refused(reason: int, header: int, body: bytes) -> str:
    with pytest.raises(PacketError) as caught:
        decode_publish(header, body)
    assert caught.value.reason == reason, str(caught.value)
    return str(caught.value)


# ---- what a broker sends ----------------------------------------------------------------


def test_a_publish_encoded_by_paho_decodes_to_the_same_fields() -> None:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.PayloadFormatIndicator = 1
    props.MessageExpiryInterval = 90
    props.ContentType = "application/octet-stream"
    props.ResponseTopic = "p/replies/\u00e9"
    props.CorrelationData = b"\x00corr\xff"
    props.UserProperty = [("Inference-Header-Content-Length", "123"), ("k", "v \u2713")]
    props.SubscriptionIdentifier = 300  # a two-byte variable byte integer
    wire = props.pack()  # type: ignore[no-untyped-call]
    body = text(TOPIC) + b"\x01\x02" + wire + b"\x00payload\xff"
    msg = decode_publish(0x3B, body)  # QoS 1, DUP, RETAIN
    assert (msg.topic, msg.qos, msg.mid, msg.payload) == (TOPIC, 1, 258, b"\x00payload\xff")
    assert msg.response_topic == "p/replies/\u00e9" and msg.correlation == b"\x00corr\xff"
    assert msg.content_type == "application/octet-stream" and msg.expiry_s == 90
    assert msg.user_properties == {"Inference-Header-Content-Length": "123", "k": "v \u2713"}
    assert msg.user_property("inference-header-content-length") == "123"
    assert msg.dedup_key() == ("corr", TOPIC, "p/replies/\u00e9", b"\x00corr\xff")


def test_qos0_without_properties_and_an_empty_payload() -> None:
    msg = decode_publish(0x30, publish(mid=None, payload=b""))
    assert (msg.topic, msg.qos, msg.mid, msg.payload) == (TOPIC, 0, 0, b"")
    assert msg.correlation is None and msg.response_topic == "" and msg.expiry_s is None
    assert msg.user_properties == {} and msg.content_type == ""


def test_the_framer_cuts_packets_however_the_bytes_arrive() -> None:
    big = b"z" * 20_000  # a remaining length of three bytes
    packets = [
        (0x32, publish(payload=b"one")),
        (0x40, b"\x00\x07"),  # a PUBACK, for paho
        (0x30, publish(mid=None, payload=big)),
        (0xD0, b""),  # a PINGRESP: no body at all
    ]
    stream = b"".join(bytes((h,)) + encode_varint(len(b)) + b for h, b in packets)
    for step in (1, 2, 7, len(stream)):
        framer, got = Framer(10**6), []
        for at in range(0, len(stream), step):
            framer.feed(stream[at : at + step])
            while (packet := framer.next()) is not None:
                got.append(packet)
        assert got == packets, step
        assert framer.pending() == 0


def test_the_framer_refuses_a_packet_over_the_limit_before_its_body() -> None:
    framer = Framer(100)
    framer.feed(b"\x30\x61")  # 2 + 97 = 99 bytes: within the limit, not here yet
    assert framer.next() is None
    framer = Framer(100)
    framer.feed(b"\x30\x63")  # 2 + 99 = 101 bytes: refused with only its header read
    with pytest.raises(PacketError) as caught:
        framer.next()
    assert caught.value.reason == PACKET_TOO_LARGE
    assert packet_limit(1000) == 1000 + PACKET_HEADROOM
    assert packet_limit(2**40) == 268_435_460  # never over what MQTT can express


@pytest.mark.parametrize(
    ("length", "words"),
    [
        (b"\xff\xff\xff\xff\x01", "over four bytes"),
        (b"\x80\x00", "fewest bytes"),  # zero in two bytes
        (b"\x85\x80\x00", "fewest bytes"),
    ],
)
def test_the_framer_refuses_a_malformed_remaining_length(length: bytes, words: str) -> None:
    framer = Framer(2**30)
    framer.feed(b"\x30" + length + b"\x00" * 8)
    with pytest.raises(PacketError, match=words) as caught:
        framer.next()
    assert caught.value.reason == MALFORMED


def test_the_framer_waits_for_a_length_cut_short() -> None:
    framer = Framer(2**30)
    framer.feed(b"\x30\xff\xff")  # a remaining length still going on
    assert framer.next() is None
    framer.feed(b"\x01")  # 3 bytes: 2,097,151
    assert framer.next() is None and framer.pending() == 4


# ---- every length checked -----------------------------------------------------------------

# the properties of a valid PUBLISH, each cut one byte short inside a property section
# that ends there (the bytes after it are payload, never read as the property's)
CUT_SHORT = [
    (b"\x01", "payload format indicator"),
    (b"\x02\x00\x00\x00", "message expiry interval"),
    (b"\x03\x00\x05abcd", "content type"),
    (b"\x03\x00", "content type"),  # its length itself cut short
    (b"\x08\x00\x03ab", "response topic"),
    (b"\x09\x00\x02c", "correlation data"),
    (b"\x26\x00\x01k\x00\x02v", "user property value"),
    (b"\x26\x00\x02k", "user property name"),
    (b"\x0b\x80", "subscription identifier"),
]


@pytest.mark.parametrize(("props", "words"), CUT_SHORT)
def test_a_property_running_past_its_section_is_malformed(props: bytes, words: str) -> None:
    body = publish(props, payload=b"PAYLOAD-NOT-A-PROPERTY")
    assert words in refused(MALFORMED, 0x32, body)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "topic name"),  # no topic length
        (b"\x00", "topic name"),
        (b"\x00\x05abc", "topic name"),  # the topic longer than the packet
        (text(TOPIC), "packet identifier"),  # QoS 1 with no packet id
        (text(TOPIC) + b"\x00", "packet identifier"),
        (text(TOPIC) + b"\x00\x07", "property length"),  # no property length
        (text(TOPIC) + b"\x00\x07\x80", "property length"),  # cut inside it
        (text(TOPIC) + b"\x00\x07\x05\x01\x00", "properties run past"),  # longer than left
    ],
)
def test_each_field_cut_short_is_malformed(body: bytes, words: str) -> None:
    assert words in refused(MALFORMED, 0x32, body)


def test_a_property_length_not_in_the_fewest_bytes_is_malformed() -> None:
    body = text(TOPIC) + b"\x00\x07\x80\x00" + b"xy"
    assert "fewest bytes" in refused(MALFORMED, 0x32, body)


# ---- the rules of MQTT v5 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "header", "body", "words"),
    [
        (MALFORMED, 0x36, publish(), "QoS 3"),
        (PROTOCOL_ERROR, 0x34, publish(), "QoS 2"),
        (MALFORMED, 0x38, publish(mid=None), "DUP"),
        (PROTOCOL_ERROR, 0x32, publish(mid=0), "packet identifier 0"),
        (PROTOCOL_ERROR, 0x40, b"\x00\x07", "not a PUBLISH"),
        (PROTOCOL_ERROR, 0x30, publish(topic="", mid=None), "no topic name"),
        (TOPIC_NAME_INVALID, 0x30, publish(topic="p/+/infer/m", mid=None), "wildcard"),
        (TOPIC_NAME_INVALID, 0x30, publish(topic="p/#", mid=None), "wildcard"),
        (MALFORMED, 0x30, publish(topic=b"p/\xff/infer", mid=None), "not valid UTF-8"),
        (MALFORMED, 0x30, publish(topic=b"p/\xed\xa0\x80", mid=None), "not valid UTF-8"),
        (MALFORMED, 0x30, publish(topic="p/\x00/m", mid=None), "U+0000"),
        (MALFORMED, 0x32, publish(b"\x03" + text(b"\xc3")), "content type is not valid"),
        (MALFORMED, 0x32, publish(b"\x26" + text("k") + text("v\x00")), "U+0000"),
        (TOPIC_ALIAS_INVALID, 0x32, publish(b"\x23\x00\x01"), "topic alias"),
        (PROTOCOL_ERROR, 0x32, publish(b"\x01\x02"), "payload format"),
        (PROTOCOL_ERROR, 0x32, publish(b"\x0b\x00"), "subscription identifier of 0"),
        (PROTOCOL_ERROR, 0x32, publish(b"\x09" + text("a") + b"\x09" + text("b")), "twice"),
        (PROTOCOL_ERROR, 0x32, publish(b"\x02\x00\x00\x00\x01" * 2), "twice"),
        (MALFORMED, 0x32, publish(b"\x11\x00\x00\x00\x01"), "not a PUBLISH property"),
        (MALFORMED, 0x32, publish(b"\x80\x01"), "not a PUBLISH property"),
    ],
)
def test_what_mqtt_v5_forbids_is_refused_with_its_reason_code(
    reason: int, header: int, body: bytes, words: str
) -> None:
    assert words in refused(reason, header, body)


def test_repeatable_properties_may_repeat() -> None:
    props = b"\x26" + text("a") + text("1") + b"\x26" + text("a") + text("2") + b"\x0b\x01\x0b\x02"
    msg = decode_publish(0x32, publish(props))
    assert msg.user_properties == {"a": "2"}  # the last of a name, as the bridge reads them


# ---- the two paho methods the bridge hooks ------------------------------------------------


def test_paho_still_builds_its_socket_in_create_socket() -> None:
    """The bridge gets paho's socket by overriding ``Client._create_socket`` (paho is
    pinned in constraints.txt). If a paho release renames or stops calling it, this
    fails here, loudly, as well as every broker test."""
    assert callable(getattr(mqtt.Client, "_create_socket", None))
    assert "self._create_socket()" in _source(mqtt.Client.reconnect)
    from appliance.adapters.mqtt.client import _Client

    assert _Client._create_socket is not mqtt.Client._create_socket
    assert hasattr(BufferedSocket, "hand")


def test_paho_still_takes_its_subscribe_ids_from_mid_generate() -> None:
    """paho's SUBSCRIBE draws its packet id from ``Client._mid_generate``, which the bridge
    points at its one allocator (``Outbound.take_id``, MQTT v5 2.2.1). If a paho release
    draws ids elsewhere, two packets in flight could share one: this fails first."""
    assert callable(getattr(mqtt.Client, "_mid_generate", None))
    assert "self._mid_generate()" in _source(mqtt.Client._send_subscribe)


def _source(function: object) -> str:
    import inspect

    return inspect.getsource(function)  # type: ignore[arg-type]
