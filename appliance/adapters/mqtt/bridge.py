"""MQTT adapter: camera producers publish requests, the appliance infers and answers.

A thin protocol adapter over :meth:`DataPlane.infer`, like HTTP and gRPC: the
payload forms, topics, de-duplication and backoff rules are in
:mod:`appliance.adapters.mqtt.protocol`; this module owns the connection: paho for
CONNECT, SUBSCRIBE, keep-alive and DISCONNECT, the bridge's own packets for requests,
replies and acknowledgements (:mod:`appliance.adapters.mqtt.link`,
:mod:`appliance.adapters.mqtt.outbound`).

One thread, the event loop, owns the connection (:class:`LoopDriver` drives its
socket by readiness; only the blocking connect, with DNS, TCP and TLS, runs on a worker
thread): the driver hands each PUBLISH to the bridge, which admits the request and
creates its task, which decodes, infers,
encodes, replies and acknowledges, and is the only party that answers its message. One
task per bridge connects, serves the connection until it ends, and reconnects with
exponential backoff plus jitter.

Bounded inbound work: the CONNECT announces ``max_pending`` as the MQTT v5 Receive
Maximum, so the broker sends at most that many QoS 1 requests we have not
acknowledged yet and keeps the rest of a backlog itself. At most ``max_pending``
requests per connection are held at once (QoS 1: up to twice that when the broker
overshoots its quota; requests still in flight from an earlier connection, which the
broker no longer counts, do not take the new connection's room); a request beyond
that is answered at once with an UNAVAILABLE "overloaded" error (and counted), never
buffered. QoS 1 requests are acknowledged (PUBACK) only once answered, so a
request in flight when the connection or the process dies is redelivered by the
broker; the de-duplication window makes a redelivery that arrives while this
process still remembers it a no-op. Replies produced while disconnected wait in a
bounded outbox and go out after the reconnect.

MQTT being down never touches HTTP or gRPC serving: :meth:`start` returns at once
and the connection task retries in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from appliance.adapters import exchange
from appliance.adapters.codec import kserve
from appliance.adapters.mqtt.client import connect_properties, make_client, reply_properties
from appliance.adapters.mqtt.codec import MqttWire
from appliance.adapters.mqtt.link import LoopDriver
from appliance.adapters.mqtt.outbound import Outbound
from appliance.adapters.mqtt.packets import PacketError, encode_puback, packet_limit
from appliance.adapters.mqtt.protocol import (
    DedupWindow,
    Inbound,
    RequestTopic,
    Room,
    Topics,
    expired,
    model_guess,
)
from appliance.adapters.mqtt.request import MqttRequest
from appliance.config.mqtt_config import MqttConfig
from appliance.core.dataplane import DataPlane
from appliance.core.stats import MqttStats
from appliance.errors import ApplianceError, Code

log = logging.getLogger(__name__)

_GOODBYE_TIMEOUT_S = 2.0


class MqttBridge:
    """Serves inference over MQTT for one device. :meth:`start`, then :meth:`stop`."""

    def __init__(self, config: MqttConfig, dataplane: DataPlane, max_request_size: int) -> None:
        self.config = config
        self.dataplane = dataplane
        self.max_request_size = max_request_size
        self.topics = Topics(
            config.topic_prefix, config.device_id, config.shared_group, config.models
        )
        self.stats = MqttStats()
        self._dedup = DedupWindow(config.dedup_window_s, config.dedup_max_entries)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room = Room(config.max_pending)  # requests in hand, by connection
        self._tasks: set[asyncio.Task[None]] = set()  # keep references: tasks are weak
        # each admitted request's task -> its connection, until its room is released
        # (exactly once: before its PUBACK, or when the task ends without one)
        self._holding: dict[asyncio.Task[None], int] = {}
        self._generation = 0  # incremented on every accepted connection
        self._socket_up = False  # paho's view, from its callbacks
        self._link_up = False  # publish directly only when True (set a callback later)
        self._outbox: deque[tuple[str, bytes, Properties]] = deque()
        self._outbox_limit = 2 * config.max_pending + 16
        self._wire = MqttWire(config.file_directory, max_request_size)
        self._driver: LoopDriver | None = None
        self._outbound: Outbound | None = None  # our publishes: replies and the status
        self._client = make_client(
            config,
            self.topics.status,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
            on_subscribe=self._on_subscribe,
        )

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the connection task; returns at once (the broker may be down)."""
        self._loop = asyncio.get_running_loop()
        limit = packet_limit(self.max_request_size)
        self._driver = LoopDriver(
            self._client, self._loop, limit, self._on_publish, self._on_puback, self._on_refused
        )
        self._outbound = Outbound(self._driver.write, self._outbox_limit)
        # one packet-id allocator for paho's SUBSCRIBE and our PUBLISH packets: two
        # counters could name two packets in flight alike (MQTT v5 section 2.2.1)
        self._client._mid_generate = self._outbound.take_id  # type: ignore[method-assign]
        self._room.open()
        cfg = self.config
        self._driver.start(
            cfg.host, cfg.port, self._connect_options, cfg.reconnect_min_s, cfg.reconnect_max_s
        )
        log.info(
            "mqtt: device '%s' serving %s via %s:%d",
            cfg.device_id,
            ", ".join(self.topics.subscriptions()),
            cfg.host,
            cfg.port,
        )

    async def stop(self, timeout_s: float) -> None:
        """Stop taking requests (new ones stay with the broker, unacknowledged) ->
        let requests in flight finish and answer for up to ``timeout_s`` -> cancel the
        rest -> publish ``offline`` -> disconnect cleanly -> end the connection task."""
        if self._driver is None:
            return  # never started
        self._room.close()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._link_up and self._outbound is not None:
            acked: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._outbound.publish(self.topics.status, b"offline", 1, retain=True, done=acked)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(acked, _GOODBYE_TIMEOUT_S)
        await self._driver.stop(_GOODBYE_TIMEOUT_S)
        if self._outbox:
            self.stats.add("dropped_reply_lost", len(self._outbox))
            self._outbox.clear()
        self._link_up = False
        self.stats.set("connected", 0)

    # ---- the connection -----------------------------------------------------------------

    def _connect_options(self) -> dict[str, Any]:
        """What each connection attempt sends (keep the session: queued QoS 1 requests
        survive a reconnect)."""
        return {
            "keepalive": self.config.keepalive_s,
            "clean_start": False,
            "properties": connect_properties(self.config, packet_limit(self.max_request_size)),
        }

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if reason.is_failure:
            log.error("mqtt: the broker refused the connection: %s", reason)
            return
        self._generation += 1
        self._socket_up = True
        if self._driver is not None:
            self._driver.accepted()  # the next reconnect starts its backoff over
        options = SubscribeOptions(qos=self.config.qos)
        client.subscribe([(topic, options) for topic in self.topics.subscriptions()])
        assert self._outbound is not None
        # what the last connection left unacknowledged goes again first, never more
        # at once than the broker's Receive Maximum (MQTT v5 section 4.9)
        self._outbound.attach(int(getattr(properties, "ReceiveMaximum", 65535)))
        # after subscribing: a producer that sees "online" finds us subscribed
        self._outbound.publish(self.topics.status, b"online", 1, retain=True)
        # then the outbox
        self._later(self._link_changed, self._generation, bool(flags.session_present))

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, properties: Any
    ) -> None:
        if self._outbound is not None:
            self._outbound.release_id(mid)
        for topic, reason in zip(self.topics.subscriptions(), reasons, strict=False):
            if reason.is_failure:
                log.error("mqtt: the broker refused the subscription %s: %s", topic, reason)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        self._socket_up = self._link_up = False  # stop direct publishes at once
        if self._outbound is not None:
            self._outbound.detach()
        self._later(self._link_changed, self._generation, False)

    def _on_puback(self, mid: int, reason: int) -> None:
        """The broker acknowledged one of our publishes (a reason >= 0x80: refused)."""
        assert self._outbound is not None
        if self._outbound.acknowledged(mid, reason) and reason >= 0x80:
            self.stats.add("dropped_reply_lost")
            log.warning("mqtt: the broker refused a reply (reason 0x%02x)", reason)

    def _on_refused(self, error: PacketError) -> None:
        """The driver refused a packet from the broker and closes the connection."""
        self.stats.add("dropped_malformed")

    def _on_publish(self, inbound: Inbound) -> None:
        """Admit one request (decoded by the driver): duplicate -> ack and drop; no
        room -> "overloaded" reply; else start its task. Never blocks, never buffers."""
        inbound.generation = self._generation
        self.stats.add("received")
        key = inbound.dedup_key()
        if key is not None and self._dedup.seen(key):
            self.stats.add("duplicates")
            self._send_ack(inbound.mid, inbound.qos)
            return
        accepting, admitted = self._room.take(inbound.generation, inbound.qos)
        if not accepting:  # stopping: leave it unacknowledged, the broker keeps it
            self._forget(key)
            return
        if not admitted:
            self._forget(key)
            self.stats.add("dropped_overloaded")
            error = ApplianceError(
                Code.UNAVAILABLE,
                f"device '{self.config.device_id}' is overloaded: "
                f"{self.config.max_pending} MQTT requests are already being served",
            )
            topic, payload, props = self._error_reply(inbound, "", error)
            self._publish(topic, payload, props)
            self.stats.add("errors")
            self._send_ack(inbound.mid, inbound.qos)
            return
        self._admit(inbound)

    # ---- requests -----------------------------------------------------------------------

    def _later(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon(callback, *args)

    def _link_changed(self, generation: int, session_present: bool) -> None:
        up = self._socket_up and generation == self._generation
        was_up, self._link_up = self._link_up, up
        self.stats.set("connected", int(up))
        if up and not was_up:
            if generation > 1:
                self.stats.add("reconnects")
            log.info(
                "mqtt: connected to %s:%d as '%s' (%s)",
                self.config.host,
                self.config.port,
                self.config.client_id,
                "session resumed" if session_present else "new session",
            )
            while self._outbox and self._link_up:
                self._publish(*self._outbox.popleft())
        elif was_up and not up:
            log.warning("mqtt: disconnected from %s:%d", self.config.host, self.config.port)

    def _admit(self, inbound: Inbound) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._serve(inbound))
        self._tasks.add(task)
        self._holding[task] = inbound.generation
        self.stats.set("in_flight", len(self._tasks))
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.stats.set("in_flight", len(self._tasks))
        self._free(task)  # a task cancelled before it ran released nothing yet

    def _free(self, task: asyncio.Task[Any] | None) -> None:
        generation = self._holding.pop(task, None) if task is not None else None
        if generation is not None:
            self._room.give_back(generation)

    def _forget(self, key: Hashable | None) -> None:
        if key is not None:
            self._dedup.forget(key)

    async def _serve(self, msg: Inbound) -> None:
        """Answer one admitted request, then acknowledge it. This task is the only
        party that replies to ``msg``. Cancelled (shutdown): no reply and no ack, so
        the broker redelivers it."""
        key = msg.dedup_key()
        model = ""
        try:
            if expired(msg):
                self.stats.add("dropped_expired")
            else:
                topic = self.topics.parse(msg.topic)
                model = topic.model
                key = await self._answer(msg, topic, key)
        except asyncio.CancelledError:
            self._forget(key)
            raise
        except ApplianceError as exc:
            if exc.code is Code.UNAVAILABLE and expired(msg):
                self.stats.add("dropped_expired")  # timed out in the queue: not inferred
            else:
                if exc.code is Code.UNAVAILABLE:
                    self._forget(key)  # nothing was inferred: a retry must be served
                self._reply(*self._error_reply(msg, model, exc))
                self.stats.add("errors")
        except Exception as exc:  # a bug: answer and keep serving
            log.exception("mqtt: request on %s failed", msg.topic)
            self._reply(*self._error_reply(msg, model, ApplianceError(Code.INTERNAL, str(exc))))
            self.stats.add("errors")
        # room first, then the PUBACK: the broker sends the next request as soon as
        # the acknowledgement reaches it, and that one must find the room free
        self._free(asyncio.current_task())
        self._ack(msg)

    async def _answer(
        self, msg: Inbound, topic: RequestTopic, key: Hashable | None
    ) -> Hashable | None:
        """The request through the one exchange (:func:`exchange.serve`): admitted by its
        payload's size before it is decoded, its reply published before its hold is
        released. Returns the request's dedup key."""
        if len(msg.payload) > self.max_request_size:
            raise ApplianceError(
                Code.TOO_LARGE,
                f"the payload has {len(msg.payload)} bytes, over the server's limit of "
                f"{self.max_request_size}",
            )
        ticket = self.dataplane.admit(topic.model, topic.version, len(msg.payload))
        request = MqttRequest(
            msg,
            topic,
            key,
            self._dedup,
            self.stats,
            self.topics,
            self.config.device_id,
            self._reply,
        )
        try:
            await exchange.serve(
                self.dataplane, self._wire, request, len(msg.payload), ticket, None, request.reply
            )
        except exchange.Dropped:  # a duplicate by its request id
            return request.key
        self.stats.add("answered")
        return request.key

    # ---- replies and acknowledgements ---------------------------------------------------

    def _error_reply(
        self, msg: Inbound, model: str, error: ApplianceError
    ) -> tuple[str, bytes, Properties]:
        """A KServe error object ``{"error": msg}`` for ``msg``, on its reply topic."""
        topic = msg.response_topic or self.topics.result(model or model_guess(msg.topic))
        props = reply_properties(
            msg, self.config.device_id, "application/json", None, error.code.value
        )
        return topic, kserve.error_body(error.message), props

    def _reply(self, topic: str, payload: bytes, props: Properties) -> None:
        """Publish now, or keep it in the bounded outbox until the next connection."""
        if self._link_up:
            self._publish(topic, payload, props)
            return
        if len(self._outbox) >= self._outbox_limit:
            self._outbox.popleft()
            self.stats.add("dropped_reply_lost")
        self._outbox.append((topic, payload, props))

    def _publish(self, topic: str, payload: bytes, props: Properties) -> None:
        assert self._outbound is not None
        try:
            sent = self._outbound.publish(topic, payload, self.config.qos, props.pack())  # type: ignore[no-untyped-call]
        except ValueError as exc:  # a response topic no PUBLISH may name
            self.stats.add("dropped_reply_lost")
            log.warning("mqtt: reply dropped: %s", exc)
            return
        if not sent:
            self.stats.add("dropped_reply_lost")
            log.warning("mqtt: reply to %s dropped: too many replies waiting for the broker", topic)

    def _send_ack(self, mid: int, qos: int) -> None:
        if qos and self._driver is not None:
            self._driver.write(encode_puback(mid))

    def _ack(self, msg: Inbound) -> None:
        # only on the connection that delivered it: after a reconnect the broker
        # redelivers the message under its own packet id and that copy is acked
        if msg.qos and self._link_up and msg.generation == self._generation:
            self._send_ack(msg.mid, msg.qos)
