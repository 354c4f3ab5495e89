"""The MQTT v5 packets the bridge reads and writes itself, with no MQTT client in it:
the incoming byte stream cut into packets (:class:`Framer`), a PUBLISH decoded into
an :class:`~appliance.adapters.mqtt.protocol.Inbound` (:func:`decode_publish`), a
PUBACK read (:func:`decode_puback`), and the PUBLISH and PUBACK packets it sends
(:func:`encode_publish`, :func:`encode_puback`).

Why not paho's: paho reads a packet a byte at a time and decodes every PUBLISH's
properties by looking each one up among all 27 MQTT v5 properties (60-80 us a
request, more than the rest of its PUBLISH handling). The bridge needs eight fields;
this reads them in one pass. paho keeps the connection's own packets (CONNECT,
CONNACK, SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT):
:class:`appliance.adapters.mqtt.link.LoopDriver` hands those to it whole.

Strict, because the broker is not trusted either: every length is checked against
what is left of its packet, a packet over the limit the CONNECT announced is refused
before its body is read, and anything MQTT v5 calls a Malformed Packet or a Protocol
Error raises :class:`PacketError` with the DISCONNECT reason code the specification
prescribes (section 4.13): the connection is then closed, never the bridge.
"""

from __future__ import annotations

from appliance.adapters.mqtt.protocol import Inbound

PUBLISH = 3  # packet types, in the high nibble of the first byte
PUBACK = 4
MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
PACKET_TOO_LARGE = 0x95
TOPIC_NAME_INVALID = 0x90
TOPIC_ALIAS_INVALID = 0x94
MAX_PACKET_SIZE = 268_435_460  # the largest remaining length and its fixed header
# what a request packet may hold beside its payload (topic, properties): a payload up
# to this much over the server's request limit is still read, and answered TOO_LARGE
PACKET_HEADROOM = 2**20

# PUBLISH properties (MQTT v5 section 3.3.2.3) by identifier
_PAYLOAD_FORMAT = 0x01
_EXPIRY = 0x02
_CONTENT_TYPE = 0x03
_RESPONSE_TOPIC = 0x08
_CORRELATION = 0x09
_SUBSCRIPTION_ID = 0x0B
_TOPIC_ALIAS = 0x23
_USER_PROPERTY = 0x26
_ONCE = frozenset({_PAYLOAD_FORMAT, _EXPIRY, _CONTENT_TYPE, _RESPONSE_TOPIC, _CORRELATION})


def packet_limit(max_request_size: int) -> int:
    """The Maximum Packet Size the bridge announces and enforces."""
    return min(max_request_size + PACKET_HEADROOM, MAX_PACKET_SIZE)


class PacketError(Exception):
    """A packet the bridge refuses; ``reason`` is the MQTT v5 DISCONNECT reason code."""

    def __init__(self, reason: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _malformed(message: str) -> PacketError:
    return PacketError(MALFORMED, message)


class Framer:
    """Cuts the bytes read from the broker into whole packets, in order.

    :meth:`feed` what was read, then take :meth:`next` until it returns None (the rest
    of a packet has not arrived yet). A packet whose size (fixed header included) is
    over ``limit`` raises as soon as its length is known: nothing of it is kept.
    """

    __slots__ = ("_buf", "_limit", "_pos")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos:  # drop the packets already taken, once per read
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next(self) -> tuple[int, bytes] | None:
        """The next whole packet as (first byte, the rest after the length), or None."""
        buf, start = self._buf, self._pos
        end = len(buf)
        if end - start < 2:
            return None
        length, at = _varint(buf, start + 1, end, "remaining length")
        if at < 0:
            return None  # the length itself is not all here yet
        total = at - start + length
        if total > self._limit:
            raise PacketError(
                PACKET_TOO_LARGE, f"a {total}-byte packet, over the {self._limit} announced"
            )
        if end - start < total:
            return None
        header = buf[start]
        body = bytes(memoryview(buf)[at : start + total])  # one copy; the view ends here
        if start + total == end:
            buf.clear()
            self._pos = 0
        else:
            self._pos = start + total
        return header, body

    def pending(self) -> int:
        """Bytes held of packets not taken yet."""
        return len(self._buf) - self._pos


def encode_varint(value: int) -> bytes:
    """``value`` as a variable byte integer (MQTT v5 section 1.5.5)."""
    out = bytearray()
    while True:
        value, byte = divmod(value, 128)
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint(data: bytes | bytearray, at: int, end: int, what: str) -> tuple[int, int]:
    """A variable byte integer at ``data[at:end]``: (value, offset after it); the
    offset is -1 when ``data`` ends inside it. Over four bytes, or not in the fewest
    bytes (MQTT v5 section 1.5.5), is malformed."""
    value = 0
    for i in range(4):
        if at + i >= end:
            return 0, -1
        byte = data[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            if byte == 0 and i:
                raise _malformed(f"the {what} is not encoded in the fewest bytes")
            return value, at + i + 1
    raise _malformed(f"the {what} is over four bytes")


class _Reader:
    """Reads the fields of one packet body; every read is checked against its end."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def take(self, size: int, what: str) -> bytes:
        pos = self.pos
        if size > self.end - pos:
            raise _malformed(f"the {what} runs past the end of its packet")
        self.pos = pos + size
        return self.data[pos : pos + size]

    def byte(self, what: str) -> int:
        if self.pos >= self.end:
            raise _malformed(f"the {what} runs past the end of its packet")
        self.pos += 1
        return self.data[self.pos - 1]

    def u16(self, what: str) -> int:
        return int.from_bytes(self.take(2, what), "big")

    def varint(self, what: str) -> int:
        value, at = _varint(self.data, self.pos, self.end, what)
        if at < 0:
            raise _malformed(f"the {what} runs past the end of its packet")
        self.pos = at
        return value

    def binary(self, what: str) -> bytes:
        return self.take(self.u16(what), what)

    def text(self, what: str) -> str:
        """A UTF-8 string: well-formed, no U+0000 (MQTT v5 section 1.5.4)."""
        raw = self.binary(what)
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(f"the {what} is not valid UTF-8") from None
        if "\x00" in value:
            raise _malformed(f"the {what} holds U+0000")
        return value


def decode_publish(header: int, body: bytes) -> Inbound:
    """A PUBLISH (its first byte, and its body after the remaining length) as the
    bridge's :class:`Inbound`. Raises :class:`PacketError` (the connection must close)
    on a Malformed Packet or Protocol Error, including QoS 2 (the bridge subscribes at
    QoS 0 or 1) and a Topic Alias (its CONNECT allows none)."""
    if header >> 4 != PUBLISH:
        raise PacketError(PROTOCOL_ERROR, f"packet type {header >> 4} is not a PUBLISH")
    qos = (header >> 1) & 3
    if qos == 3:
        raise _malformed("a PUBLISH with QoS 3")
    if qos == 2:
        raise PacketError(PROTOCOL_ERROR, "a PUBLISH with QoS 2 on a QoS 0/1 subscription")
    if qos == 0 and header & 0x08:
        raise _malformed("a QoS 0 PUBLISH with the DUP flag")
    r = _Reader(body, 0, len(body))
    topic = r.text("topic name")
    if not topic:
        raise PacketError(PROTOCOL_ERROR, "a PUBLISH with no topic name and no topic alias")
    if "+" in topic or "#" in topic:
        raise PacketError(TOPIC_NAME_INVALID, f"the topic name {topic!r} holds a wildcard")
    mid = 0
    if qos:
        mid = r.u16("packet identifier")
        if mid == 0:
            raise PacketError(PROTOCOL_ERROR, "a PUBLISH with packet identifier 0")
    inbound = Inbound(topic=topic, payload=b"", qos=qos, mid=mid)
    length = r.varint("property length")
    if length > r.end - r.pos:
        raise _malformed("the properties run past the end of their packet")
    payload_at = r.pos + length
    _read_properties(_Reader(body, r.pos, payload_at), inbound)
    inbound.payload = body[payload_at:]
    return inbound


def _read_properties(r: _Reader, inbound: Inbound) -> None:
    seen: set[int] = set()
    user: dict[str, str] = {}
    while r.pos < r.end:
        ident = r.byte("property identifier")
        if ident in _ONCE:
            if ident in seen:
                raise PacketError(PROTOCOL_ERROR, f"property 0x{ident:02x} appears twice")
            seen.add(ident)
        if ident == _USER_PROPERTY:
            key = r.text("user property name")
            user[key] = r.text("user property value")
        elif ident == _CORRELATION:
            inbound.correlation = r.binary("correlation data")
        elif ident == _RESPONSE_TOPIC:
            inbound.response_topic = r.text("response topic")
        elif ident == _CONTENT_TYPE:
            inbound.content_type = r.text("content type")
        elif ident == _EXPIRY:
            inbound.expiry_s = int.from_bytes(r.take(4, "message expiry interval"), "big")
        elif ident == _PAYLOAD_FORMAT:
            if r.byte("payload format indicator") > 1:
                raise PacketError(PROTOCOL_ERROR, "a payload format indicator other than 0 or 1")
        elif ident == _SUBSCRIPTION_ID:
            if r.varint("subscription identifier") == 0:
                raise PacketError(PROTOCOL_ERROR, "a subscription identifier of 0")
        elif ident == _TOPIC_ALIAS:
            raise PacketError(TOPIC_ALIAS_INVALID, "a topic alias (the CONNECT allowed none)")
        else:
            raise _malformed(f"property 0x{ident:02x} is not a PUBLISH property")
    if user:
        inbound.user_properties = user


def decode_puback(header: int, body: bytes) -> tuple[int, int]:
    """A PUBACK: (packet identifier, reason code; 0 when the broker left it out)."""
    if header != PUBACK << 4:
        raise _malformed(f"a PUBACK with flags 0x{header & 0x0F:x}")
    r = _Reader(body, 0, len(body))
    mid = r.u16("packet identifier")
    if mid == 0:
        raise PacketError(PROTOCOL_ERROR, "a PUBACK with packet identifier 0")
    reason = r.byte("reason code") if r.pos < r.end else 0
    if r.pos < r.end:  # properties (a reason string, user properties): checked, unused
        length = r.varint("property length")
        if length != r.end - r.pos:
            raise _malformed("the PUBACK's properties do not end with it")
    return mid, reason


def encode_publish(
    topic: str, payload: bytes, qos: int, mid: int, properties: bytes, retain: bool = False
) -> bytes:
    """A PUBLISH packet; ``properties`` is the packed property section (its length
    first). The DUP flag of a resend is :func:`as_resend`'s. ValueError: a topic that
    no PUBLISH may carry (empty, a wildcard, over 65535 bytes, U+0000)."""
    raw = topic.encode()
    if not raw or len(raw) > 0xFFFF or "+" in topic or "#" in topic or "\x00" in topic:
        raise ValueError(f"{topic!r} is not a topic a PUBLISH may name")
    head = bytes((PUBLISH << 4 | qos << 1 | int(retain),))
    ident = mid.to_bytes(2, "big") if qos else b""
    length = 2 + len(raw) + len(ident) + len(properties) + len(payload)
    return b"".join(
        (head, encode_varint(length), len(raw).to_bytes(2, "big"), raw, ident, properties, payload)
    )


def as_resend(packet: bytes) -> bytes:
    """A QoS 1 PUBLISH packet with its DUP flag set (sent again after a reconnect)."""
    return bytes((packet[0] | 0x08,)) + packet[1:]


def encode_puback(mid: int) -> bytes:
    """The acknowledgement of a QoS 1 PUBLISH (reason Success, no properties)."""
    return b"\x40\x02" + mid.to_bytes(2, "big")
