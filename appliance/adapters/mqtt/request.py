"""One MQTT request on its way through the one exchange (:mod:`appliance.adapters.exchange`):
what :class:`appliance.adapters.mqtt.codec.MqttWire` reads (``msg``, ``topic``), its
last look before inference (de-duplication by request id, the message's expiry), and
its reply, published before its hold is released. Made per request by
:mod:`appliance.adapters.mqtt.bridge`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from paho.mqtt.properties import Properties

from appliance.adapters.mqtt.client import reply_properties
from appliance.adapters.mqtt.codec import Reply
from appliance.adapters.mqtt.protocol import DedupWindow, Inbound, RequestTopic, Topics
from appliance.core.stats import MqttStats
from appliance.request import InferenceRequest

Publish = Callable[[str, bytes, Properties], None]  # the bridge's reply (or outbox)


class MqttRequest:
    """See the module docstring; ``key``: its de-duplication key, set from its request
    id when it came without correlation data."""

    __slots__ = ("_dedup", "_device", "_publish", "_stats", "_topics", "key", "msg", "topic")

    def __init__(
        self,
        msg: Inbound,
        topic: RequestTopic,
        key: Hashable | None,
        dedup: DedupWindow,
        stats: MqttStats,
        topics: Topics,
        device_id: str,
        publish: Publish,
    ) -> None:
        self.msg, self.topic, self.key = msg, topic, key
        self._dedup, self._stats, self._topics = dedup, stats, topics
        self._device, self._publish = device_id, publish

    def proceed(self, request: InferenceRequest) -> bool:
        """Before inference: a request without correlation data is identified by its id
        (a duplicate is dropped); the message's expiry bounds its time in the queue."""
        msg = self.msg
        if self.key is None and request.id:
            self.key = ("id", msg.topic, msg.response_topic, request.id)
            if self._dedup.seen(self.key):
                self._stats.add("duplicates")
                return False
        deadline = msg.deadline
        if deadline is not None:
            left_us = max(1, int((deadline - time.monotonic()) * 1e6))
            request.timeout_us = min(request.timeout_us or left_us, left_us)
        return True

    def reply(self, answer: Reply) -> None:
        """Publish the answer (or keep it in the outbox): before the hold is released."""
        body, length = answer
        msg = self.msg
        content = "application/json" if length is None else "application/octet-stream"
        props = reply_properties(msg, self._device, content, length, "")
        self._publish(msg.response_topic or self._topics.result(self.topic.model), body, props)
