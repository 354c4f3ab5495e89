"""The PUBLISH packets the bridge sends (replies, its status) and their
acknowledgements, with no MQTT client in it.

paho spent more on a reply than the bridge does on the rest of its answer: a
``publish`` (some 10 us), the broker's PUBACK read a byte at a time and decoded into a
fresh properties object (some 20 us), the request's own PUBACK (4 us). Here a reply is
one packet encoded in one join and written; the broker's PUBACK is two bytes looked up
in a dict.

:class:`Outbound` keeps what MQTT v5 asks of a QoS 1 sender (section 4.4): at most
``window`` unacknowledged PUBLISH packets (the broker's Receive Maximum, never more
than the bridge's own cap), packet identifiers unique among them and paho's SUBSCRIBE
(one allocator, :meth:`Outbound.take_id`, for both: MQTT v5 section 2.2.1), the rest queued in
order up to ``queue_limit``, and every unacknowledged one sent again, with DUP set,
on the next connection, before anything new. Loop-only: every call is made on the
event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from appliance.adapters.mqtt.packets import as_resend, encode_publish

WritePacket = Callable[[bytes], None]  # one whole packet onto the connection

WINDOW = 20  # unacknowledged QoS 1 publishes at most (paho's and mosquitto's default)
NO_PROPERTIES = b"\x00"


class Outbound:
    """Our QoS 0 and QoS 1 publishes on the current connection (see the module)."""

    def __init__(self, write: WritePacket, queue_limit: int, cap: int = WINDOW) -> None:
        self._write = write
        self._queue_limit = queue_limit
        self._cap = cap
        self._window = cap
        self._attached = False
        self._mid = 0
        self._others: set[int] = set()  # ids paho's packets (SUBSCRIBE) hold until acked
        # packet id -> (the packet as first sent, who waits for its PUBACK), in order
        self._unacked: dict[int, tuple[bytes, asyncio.Future[int] | None]] = {}
        self._queued: deque[tuple[bytes, asyncio.Future[int] | None]] = deque()

    @property
    def unacknowledged(self) -> int:
        return len(self._unacked)

    @property
    def queued(self) -> int:
        return len(self._queued)

    def attach(self, receive_maximum: int) -> None:
        """A connection was accepted: resend what is unacknowledged (DUP), then what
        waited, within the broker's Receive Maximum."""
        self._attached = True
        self._window = window = max(1, min(self._cap, receive_maximum))
        if len(self._unacked) > window:  # a smaller window now: the newest wait their turn
            kept = list(self._unacked.items())
            self._unacked = dict(kept[:window])
            self._queued.extendleft(entry for _, entry in reversed(kept[window:]))
        for packet, _ in self._unacked.values():
            self._write(as_resend(packet))
        self._send_queued()

    def detach(self) -> None:
        """The connection ended: nothing is written until the next :meth:`attach`."""
        self._attached = False
        self._others.clear()  # a SUBSCRIBE's id lives on its connection only

    def take_id(self) -> int:
        """A packet id for a packet paho sends (SUBSCRIBE), unique among ours in flight
        and its own, until :meth:`release_id` (its acknowledgement came)."""
        mid = self._next_mid()
        self._others.add(mid)
        return mid

    def release_id(self, mid: int) -> None:
        self._others.discard(mid)

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        properties: bytes = NO_PROPERTIES,
        retain: bool = False,
        done: asyncio.Future[int] | None = None,
    ) -> bool:
        """Send (QoS 1: or queue) one message; False: dropped, the queue is full (or
        QoS 0 while detached). ``done`` gets the broker's PUBACK reason code.
        ValueError: a topic no PUBLISH may name."""
        if not qos:
            packet = encode_publish(topic, payload, 0, 0, properties, retain)
            if self._attached:
                self._write(packet)
            return self._attached
        if len(self._unacked) < self._window and self._attached and not self._queued:
            mid = self._next_mid()
            self._send(encode_publish(topic, payload, 1, mid, properties, retain), mid, done)
            return True
        if len(self._queued) >= self._queue_limit:
            return False
        # the packet id is given when it is sent: it must be unique among those in flight
        self._queued.append((encode_publish(topic, payload, 1, 0, properties, retain), done))
        return True

    def acknowledged(self, mid: int, reason: int) -> bool:
        """The broker's PUBACK: False when it names no publish of ours (ignored)."""
        entry = self._unacked.pop(mid, None)
        if entry is None:
            return False
        done = entry[1]
        if done is not None and not done.done():
            done.set_result(reason)
        self._send_queued()
        return True

    def _send_queued(self) -> None:
        while self._attached and self._queued and len(self._unacked) < self._window:
            packet, done = self._queued.popleft()
            mid = self._next_mid()
            at = _id_offset(packet)  # the placeholder id 0, after the topic
            self._send(packet[:at] + mid.to_bytes(2, "big") + packet[at + 2 :], mid, done)

    def _send(self, packet: bytes, mid: int, done: asyncio.Future[int] | None) -> None:
        self._unacked[mid] = (packet, done)
        if self._attached:
            self._write(packet)

    def _next_mid(self) -> int:
        mid = self._mid
        while True:
            mid = mid % 0xFFFF + 1
            if mid not in self._unacked and mid not in self._others:
                self._mid = mid
                return mid


def _id_offset(packet: bytes) -> int:
    """Where a PUBLISH packet's packet identifier is (after its length and topic)."""
    at = 1
    while packet[at] & 0x80:
        at += 1
    at += 1
    return at + 2 + int.from_bytes(packet[at : at + 2], "big")
