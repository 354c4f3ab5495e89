"""The paho client as the MQTT bridge uses it: construction, the CONNECT and
PUBLISH properties, and inbound messages turned into :class:`Inbound` values.

Everything paho-specific that is not the bridge's concurrency lives here, so
:mod:`appliance.adapters.mqtt_bridge` reads as the threads-and-ownership contract it is.
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

from appliance.adapters.mqtt_protocol import HEADER_LENGTH, Inbound
from appliance.config.server_config import MqttConfig

RECEIVE_MAXIMUM_LIMIT = 65535  # the largest value MQTT v5 allows


def make_client(
    cfg: MqttConfig,
    status_topic: str,
    queue_limit: int,
    *,
    on_connect: Callable[..., None],
    on_disconnect: Callable[..., None],
    on_message: Callable[..., None],
    on_subscribe: Callable[..., None],
) -> mqtt.Client:
    """A paho MQTT v5 client: manual acknowledgements, no reconnects of its own (the
    bridge's network thread reconnects, with jitter), the ``offline`` will, TLS and
    credentials from the config, and publishing from the event loop that only queues."""
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=cfg.client_id,
        protocol=MQTTProtocolVersion.MQTTv5,
        manual_ack=True,  # PUBACK once answered: an unanswered request is redelivered
        reconnect_on_failure=False,  # our thread reconnects, with jitter
    )
    client.enable_logger(logging.getLogger("appliance.adapters.mqtt_bridge.paho"))
    client.suppress_exceptions = True  # a failing callback is logged, the thread lives
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
    client.max_queued_messages_set(queue_limit)
    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    client.on_message = on_message
    client.on_subscribe = on_subscribe
    # with a write callback registered, publish() from the event loop only queues
    # the packet and wakes the network thread, which alone touches the socket
    client.on_socket_register_write = _ignore
    client.on_socket_unregister_write = _ignore
    client.on_socket_open = _no_delay
    return client


def connect_properties(cfg: MqttConfig) -> Properties:
    """CONNECT: keep the session for ``session_expiry_s``; announce ``max_pending`` as
    the Receive Maximum, so the broker sends no more unacknowledged QoS 1 requests
    than we serve at once (we acknowledge once answered) and holds a backlog for us."""
    properties = _new_properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = cfg.session_expiry_s
    properties.ReceiveMaximum = min(cfg.max_pending, RECEIVE_MAXIMUM_LIMIT)
    return properties


def reply_properties(
    msg: Inbound, device_id: str, content_type: str, header_length: int | None, code: str
) -> Properties:
    """PUBLISH properties of a reply: the request's correlation data, the content
    type, and user properties naming the device (and the binary header's length or
    the error code)."""
    props = _new_properties(PacketTypes.PUBLISH)
    if msg.correlation is not None:
        props.CorrelationData = msg.correlation
    props.ContentType = content_type
    user = [("device-id", device_id)]
    if header_length is not None:
        user.append((HEADER_LENGTH, str(header_length)))
    if code:
        user.append(("error-code", code))
    props.UserProperty = user
    return props


def inbound_message(message: mqtt.MQTTMessage, generation: int) -> Inbound:
    """paho's message as the bridge's value, tagged with the connection it came on."""
    props = message.properties
    expiry = getattr(props, "MessageExpiryInterval", None)
    return Inbound(
        topic=message.topic,
        payload=bytes(message.payload),
        qos=message.qos,
        mid=message.mid,
        response_topic=getattr(props, "ResponseTopic", "") or "",
        correlation=getattr(props, "CorrelationData", None),
        content_type=getattr(props, "ContentType", "") or "",
        expiry_s=int(expiry) if expiry is not None else None,
        user_properties=dict(getattr(props, "UserProperty", None) or []),
        generation=generation,
    )


def _ignore(*args: Any) -> None:
    pass


def _no_delay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """Request/response over MQTT is small writes both ways: without TCP_NODELAY
    (paho does not set it) Nagle's algorithm and delayed ACKs add ~40 ms stalls."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _new_properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]
