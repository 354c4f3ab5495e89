"""What the MQTT bridge speaks, with no MQTT client in it: topics, payload forms,
the de-duplication window and the reconnect backoff.

Pure and synchronous, so every rule here is testable without a broker; the
bridge (``appliance/adapters/mqtt/bridge.py``) owns the paho client and the event loop.

The payload forms and how a payload becomes a request are
:mod:`appliance.adapters.mqtt.codec`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from appliance import names
from appliance.adapters.codec import kserve
from appliance.errors import invalid

HEADER_LENGTH = kserve.HEADER_LENGTH
FILE_PARAMETER = kserve.FILE_PARAMETER


# ---- topics ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestTopic:
    """A parsed request topic. ``shared``: it came through the shared subscription."""

    model: str
    version: str = ""
    shared: bool = False


class Topics:
    """Topic names of one device.

    ``<prefix>/<device>/infer/<model>[/<version>]``: requests to this device;
    ``<prefix>/infer/<model>[/<version>]``: requests to the fleet, taken through
    ``$share/<group>/...`` by one member of the group;
    ``<prefix>/<device>/result/<model>``: replies to requests without a v5 response topic;
    ``<prefix>/<device>/status``: retained ``online`` / ``offline`` (the Last Will).
    """

    def __init__(
        self, prefix: str, device_id: str, shared_group: str = "", models: tuple[str, ...] = ()
    ) -> None:
        self.prefix = prefix
        self.device_id = device_id
        self.shared_group = shared_group
        self.models = models
        self.status = f"{prefix}/{device_id}/status"
        self._device_infer = f"{prefix}/{device_id}/infer/"
        self._shared_infer = f"{prefix}/infer/"

    def result(self, model: str) -> str:
        return f"{self.prefix}/{self.device_id}/result/{model}"

    def subscriptions(self) -> list[str]:
        """Topic filters to subscribe to (after every connect)."""
        names = list(self.models) or ["+"]
        bases = [self._device_infer]
        if self.shared_group:
            bases.append(f"$share/{self.shared_group}/{self._shared_infer}")
        return [f"{base}{name}{tail}" for base in bases for name in names for tail in ("", "/+")]

    def parse(self, topic: str) -> RequestTopic:
        """The model and version a request topic names; INVALID_ARG otherwise."""
        if topic.startswith(self._device_infer):
            rest, shared = topic[len(self._device_infer) :], False
        elif self.shared_group and topic.startswith(self._shared_infer):
            rest, shared = topic[len(self._shared_infer) :], True
        else:
            raise invalid(f"topic {topic!r} is not a request topic of this device")
        parts = rest.split("/")
        if len(parts) > 2 or not all(parts):
            raise invalid(
                f"topic {topic!r}: expected .../infer/<model> or .../infer/<model>/<version>"
            )
        model = names.check_model_name(parts[0])
        version = names.check_version(parts[1] if len(parts) == 2 else "")
        if self.models and model not in self.models:
            raise invalid(f"model '{model}' is not served over MQTT on this device")
        return RequestTopic(model, version, shared)


# ---- an inbound message ---------------------------------------------------------------


@dataclass(slots=True)
class Inbound:
    """One request message as the bridge received it (MQTT client types left behind)."""

    topic: str
    payload: bytes
    qos: int = 0
    mid: int = 0
    response_topic: str = ""
    correlation: bytes | None = None
    content_type: str = ""
    expiry_s: int | None = None  # v5 Message Expiry Interval as forwarded by the broker
    user_properties: dict[str, str] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)
    generation: int = 0  # which connection delivered it (acks go back on that one only)

    @property
    def deadline(self) -> float | None:
        """Monotonic time after which the request is expired (None: never)."""
        return None if self.expiry_s is None else self.arrival + self.expiry_s

    def user_property(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.user_properties.items():
            if key.lower() == lowered:
                return value
        return None

    def dedup_key(self) -> Hashable | None:
        """What identifies a redelivery of this request before decoding: the v5
        correlation data with the topics it came on and goes to."""
        if self.correlation is None:
            return None
        return ("corr", self.topic, self.response_topic, self.correlation)


# ---- de-duplication -------------------------------------------------------------------


class DedupWindow:
    """Request keys seen in the last ``window_s`` seconds, at most ``max_entries``.

    QoS 1 is at-least-once: a redelivered request (same key) within the window is
    answered once. Memory is bounded: the oldest keys go first when it is full,
    so a key older than the window *or* pushed out by newer ones is forgotten.
    Thread-safe (the bridge checks keys on the MQTT network thread and the loop).
    """

    def __init__(
        self, window_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._clock = clock
        self._seen: OrderedDict[Hashable, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, key: Hashable) -> bool:
        """True if ``key`` was recorded within the window; otherwise record it now."""
        now = self._clock()
        with self._lock:
            while self._seen:
                oldest, at = next(iter(self._seen.items()))
                if now - at < self.window_s and len(self._seen) < self.max_entries:
                    break
                del self._seen[oldest]
            if key in self._seen:
                return True
            self._seen[key] = now
            return False

    def forget(self, key: Hashable) -> None:
        """Drop ``key`` (its request was not answered: a redelivery must be served)."""
        with self._lock:
            self._seen.pop(key, None)


# ---- reconnect backoff ----------------------------------------------------------------


def backoff_delay(attempt: int, base_s: float, cap_s: float, random: Callable[[], float]) -> float:
    """Seconds to wait before reconnect ``attempt`` (0 = the first retry).

    Exponential with "equal jitter": half of ``min(cap, base * 2**attempt)`` fixed, the
    other half uniformly random, so a fleet that lost its broker at the same moment
    does not come back at the same moment, yet no device retries in a tight loop.
    """
    ceiling = min(cap_s, base_s * float(2 ** min(attempt, 32)))
    return ceiling / 2 + random() * ceiling / 2


def expired(msg: Inbound) -> bool:
    """Whether the request's message expiry passed (it is dropped, not inferred)."""
    deadline = msg.deadline
    return deadline is not None and time.monotonic() >= deadline


def model_guess(topic: str) -> str:
    """The model level of an unparseable request topic, for its error reply."""
    parts = topic.split("/infer/", 1)
    return parts[1].split("/")[0] if len(parts) == 2 and parts[1] else "unknown"


class Room:
    """The requests in hand, counted per connection (generation): the broker's Receive
    Maximum counts per connection, and requests still in flight from an earlier
    connection must not take the new one's room. Thread-safe: paho's network thread
    takes room, the event loop gives it back."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}
        self._accepting = False

    def open(self) -> None:
        with self._lock:
            self._accepting = True

    def close(self) -> None:
        """No more requests are taken (stopping): the broker keeps them."""
        with self._lock:
            self._accepting = False

    def take(self, generation: int, qos: int) -> tuple[bool, bool]:
        """(accepting, admitted) for one more request on connection ``generation``.
        QoS 1: the broker counts our unacknowledged requests against the Receive
        Maximum we announced; one that overshoots it (mosquitto 2.0 was seen sending one
        more right after an acknowledgement) is taken, up to twice max_pending, rather
        than answered "overloaded" while the model idles."""
        with self._lock:
            held = self._held.get(generation, 0)
            admitted = self._accepting and held < self.max_pending * (2 if qos else 1)
            if admitted:
                self._held[generation] = held + 1
            return self._accepting, admitted

    def give_back(self, generation: int) -> None:
        with self._lock:
            left = self._held[generation] - 1
            if left:
                self._held[generation] = left
            else:
                del self._held[generation]
