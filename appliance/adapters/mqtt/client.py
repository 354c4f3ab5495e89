"""The paho client as the MQTT bridge uses it: construction, and the CONNECT and
PUBLISH properties. Incoming PUBLISH packets never reach paho: the bridge reads them
(:mod:`appliance.adapters.mqtt.packets`, through the socket built here).

Everything paho-specific lives here and in :mod:`appliance.adapters.mqtt.link` (the
connection on the event loop), so :mod:`appliance.adapters.mqtt.bridge` reads as the
admission-and-ownership contract it is.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from appliance.adapters.mqtt.packets import encode_varint
from appliance.adapters.mqtt.protocol import HEADER_LENGTH, Inbound
from appliance.adapters.mqtt.socket import BufferedSocket
from appliance.config.mqtt_config import MqttConfig

RECEIVE_MAXIMUM_LIMIT = 65535  # the largest value MQTT v5 allows


def make_client(
    cfg: MqttConfig,
    status_topic: str,
    *,
    on_connect: Callable[..., None],
    on_disconnect: Callable[..., None],
    on_subscribe: Callable[..., None],
) -> mqtt.Client:
    """A paho MQTT v5 client: manual acknowledgements, no reconnects of its own (the
    bridge reconnects, with jitter), the ``offline`` will, TLS and credentials from the
    config. Its socket is driven by a :class:`appliance.adapters.mqtt.link.LoopDriver`,
    which reads the incoming packets itself (no ``on_message``: paho sees no PUBLISH)."""
    client = _Client(
        CallbackAPIVersion.VERSION2,
        client_id=cfg.client_id,
        protocol=MQTTProtocolVersion.MQTTv5,
        manual_ack=True,  # PUBACK once answered: an unanswered request is redelivered
        reconnect_on_failure=False,  # the bridge reconnects, with jitter
    )
    client.enable_logger(logging.getLogger("appliance.adapters.mqtt.bridge.paho"))
    client.suppress_exceptions = True  # a failing callback is logged, the connection lives
    client.will_set(status_topic, b"offline", qos=1, retain=True)
    if cfg.username:
        client.username_pw_set(cfg.username, cfg.password or None)
    if cfg.tls is not None:
        t = cfg.tls
        client.tls_set(
            ca_certs=str(t.ca_file) if t.ca_file else None,
            certfile=str(t.cert_file) if t.cert_file else None,
            keyfile=str(t.key_file) if t.key_file else None,
        )
    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    client.on_subscribe = on_subscribe
    client.on_socket_open = _no_delay
    return client


class _Client(mqtt.Client):
    """paho's client on a :class:`BufferedSocket`, which reads paho only the packets
    the driver hands it. paho builds every connection's socket in ``_create_socket``
    (the one paho method overridden; paho is pinned in constraints.txt and
    tests/adapters/test_mqtt_packets.py fails if the hook stops being called); a paho
    that stops calling it gets no connection: the driver refuses its bare socket."""

    def _create_socket(self) -> Any:
        return BufferedSocket(super()._create_socket())


def connect_properties(cfg: MqttConfig, packet_limit: int) -> Properties:
    """CONNECT: keep the session for ``session_expiry_s``; announce ``max_pending`` as
    the Receive Maximum, so the broker sends no more unacknowledged QoS 1 requests
    than we serve at once (we acknowledge once answered) and holds a backlog for us;
    announce ``packet_limit`` as the Maximum Packet Size, so the broker discards a
    larger message instead of sending it (one that comes all the same is refused)."""
    properties = _new_properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = cfg.session_expiry_s
    properties.ReceiveMaximum = min(cfg.max_pending, RECEIVE_MAXIMUM_LIMIT)
    properties.MaximumPacketSize = packet_limit
    return properties


def reply_properties(
    msg: Inbound, device_id: str, content_type: str, header_length: int | None, code: str
) -> Properties:
    """PUBLISH properties of a reply: the request's correlation data, the content
    type, and user properties naming the device (and the binary header's length or
    the error code)."""
    user = [("device-id", device_id)]
    if header_length is not None:
        user.append((HEADER_LENGTH, str(header_length)))
    if code:
        user.append(("error-code", code))
    return PackedProperties(msg.correlation, content_type, user)


class PackedProperties(Properties):
    """A reply's PUBLISH properties (correlation data, content type, user properties),
    packed once into their wire form (MQTT v5 section 2.2.2) when made.

    paho's :class:`Properties` finds every attribute by name among all 27 MQTT v5
    properties, each time it is set or packed: some 30 us for a reply's few. paho only
    ever calls ``pack()`` on the properties given to ``publish`` (also when it sends
    the message again after a reconnect), so that is all this class answers; its
    attributes read as paho's would.
    """

    def __init__(
        self, correlation: bytes | None, content_type: str, user: list[tuple[str, str]]
    ) -> None:
        wire = bytearray(b"\x03" + _sized(content_type.encode()))  # Content Type: UTF-8
        if correlation is not None:
            wire += b"\x09" + _sized(correlation)  # Correlation Data: binary data
        for key, value in user:  # User Property: UTF-8 string pairs
            wire += b"\x26" + _sized(key.encode()) + _sized(value.encode())
        fields = {"packetType": PacketTypes.PUBLISH, "ContentType": content_type}
        if correlation is not None:
            fields["CorrelationData"] = correlation
        fields["UserProperty"] = user
        fields["_wire"] = encode_varint(len(wire)) + bytes(wire)
        self.__dict__.update(fields)  # paho's __setattr__ is what this class avoids

    def pack(self) -> bytes:
        wire: bytes = self.__dict__["_wire"]
        return wire

    def __str__(self) -> str:
        shown = {k: v for k, v in self.__dict__.items() if k[0].isupper()}
        return f"[{PacketTypes.Names[PacketTypes.PUBLISH]}] {shown}"


def _sized(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"an MQTT property value has {len(data)} bytes, over 65535")
    return len(data).to_bytes(2, "big") + data


def _no_delay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """Request/response over MQTT is small writes both ways: without TCP_NODELAY
    (paho does not set it) Nagle's algorithm and delayed ACKs add ~40 ms stalls."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _new_properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]
