"""A real mosquitto broker for the MQTT tests, and a small synchronous MQTT v5 client.

:class:`Broker` writes its own config (``listener PORT 127.0.0.1``,
``allow_anonymous true``, optional persistence) into a temporary directory,
starts Debian's ``mosquitto`` on a free loopback port, and stops it by PID.
``scripts/test.sh`` installs the package; without it the MQTT tests skip, except
under CI, where they fail instead of hiding.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

_ids = itertools.count()


def find_mosquitto() -> str | None:
    """Debian installs the broker in /usr/sbin, which is not on every PATH."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)),
        None,
    )


def require_mosquitto() -> str:
    """The broker binary; the calling test skips without one, and fails under CI, which
    installs it (scripts/test.sh): a missing broker must not pass silently there."""
    binary = find_mosquitto()
    if binary is None:
        reason = "mosquitto not found: install Debian's 'mosquitto' (scripts/test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def free_port() -> int:
    """A loopback port that is free now, for a process the test starts next (which binds
    it itself, a moment later).

    Taken at random below the kernel's ephemeral range (``ip_local_port_range``) where
    that leaves room: no ``bind(("127.0.0.1", 0))`` or outgoing connection of any other
    process (the other test worker starts servers on port 0 all the time) is handed it
    meanwhile, nor while a broker restarts on it; only another ``free_port()`` could
    pick the same one, one chance in thousands, and each checks that it is free."""
    low = _ephemeral_low()
    for _ in range(200):  # bounded; ports in use (another service's) are passed over
        port = _pick.randrange(_FIRST_PORT, low) if low - _FIRST_PORT >= 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise AssertionError("no free loopback port found")


_FIRST_PORT = 10000
_pick = random.Random()  # seeded from the OS: each test worker draws its own ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 by default, also elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy (bounded in time)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Broker:
    """One mosquitto process; :meth:`stop` then :meth:`start` restarts it on the same port."""

    def __init__(
        self, binary: str, workdir: Path, persistence: bool = False, extra: Iterable[str] = ()
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.persistence = persistence
        self.extra = list(extra)  # more mosquitto.conf lines
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "mosquitto.log"

    def _config(self) -> Path:
        lines = [
            f"listener {self.port} 127.0.0.1",
            "allow_anonymous true",
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.workdir}/",
            "max_queued_messages 10000",
            "set_tcp_nodelay true",  # request/response: no Nagle stalls on the broker's side
            f"log_dest file {self.log}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
        ]
        lines += self.extra
        if os.geteuid() == 0:  # as root mosquitto would switch to its own user, which
            lines.append("user root")  # cannot write the test's private directory
        path = self.workdir / "mosquitto.conf"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    def start(self) -> None:
        config = self._config()
        self.process = subprocess.Popen(
            [self.binary, "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on port {self.port}: {self.log_text()}")

    def stop(self) -> None:
        """SIGTERM by PID (mosquitto saves its persistence file), SIGKILL after 10 s."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)

    def kill(self) -> None:
        """SIGKILL by PID: the broker dies without saving (what a power cut does)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def saves(self) -> int:
        """How many times the broker has written its persistence file (from its log)."""
        return self.log_text().count("Saving in-memory database")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"


@dataclass
class Reply:
    topic: str
    payload: bytes
    correlation: bytes | None
    user: dict[str, str] = field(default_factory=dict)
    content_type: str = ""
    retain: bool = False
    dup: bool = False  # the broker sent it again (a redelivery after a reconnect)


class Client:
    """A synchronous MQTT v5 test client: publishes requests and collects replies.

    ``session=True`` keeps a persistent session (clean_start False), so replies
    published while a broker restarts are queued for it.
    """

    def __init__(
        self, port: int, session: bool = False, login: tuple[str, str] | None = None
    ) -> None:
        self.client_id = f"test-client-{os.getpid()}-{next(_ids)}"
        self.replies: queue.Queue[Reply] = queue.Queue()
        self._connected = False
        c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        c.reconnect_delay_set(0.05, 0.2)  # type: ignore[arg-type]
        if login is not None:  # (user name, password) for a broker that requires them
            c.username_pw_set(*login)
        c.on_message = self._on_message
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 300 if session else 0
        c.connect("127.0.0.1", port, keepalive=10, clean_start=not session, properties=props)
        c.loop_start()
        self.client = c
        wait_until(lambda: self._connected, what="the test client to connect")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._connected = not reason.is_failure

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, p: Any) -> None:
        self._connected = False

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        props = message.properties
        self.replies.put(
            Reply(
                message.topic,
                message.payload,
                getattr(props, "CorrelationData", None),
                dict(getattr(props, "UserProperty", None) or []),
                getattr(props, "ContentType", "") or "",
                bool(message.retain),
                bool(message.dup),
            )
        )

    @property
    def connected(self) -> bool:
        return self._connected

    def subscribe(self, *topics: str) -> None:
        result, _ = self.client.subscribe([(t, SubscribeOptions(qos=1)) for t in topics])
        assert result == 0
        # a round trip through the broker: the SUBACK has come back once this returns
        self.ping()

    def ping(self) -> None:
        topic = f"test/ping/{self.client_id}"
        self.client.subscribe(topic, qos=1)
        token = os.urandom(8)
        self.client.publish(topic, token, qos=1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reply = self.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            if reply.topic == topic and reply.payload == token:
                self.client.unsubscribe(topic)
                return
            self.replies.put(reply)  # not ours: keep it for the test
            time.sleep(0.01)
        raise AssertionError("ping through the broker timed out")

    def publish(
        self,
        topic: str,
        payload: bytes,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        user: Iterable[tuple[str, str]] = (),
        expiry_s: int | None = None,
        content_type: str | None = None,
        qos: int = 1,
        wait: bool = True,
    ) -> Any:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        if content_type is not None:
            props.ContentType = content_type
        user = list(user)
        if user:
            props.UserProperty = user
        info = self.client.publish(topic, payload, qos=qos, properties=props)
        if wait and qos:
            info.wait_for_publish(10)
        return info

    def collect(self, count: int, timeout: float = 15.0, topic: str | None = None) -> list[Reply]:
        """The next ``count`` replies (on ``topic`` only, when given: others are
        discarded); fails if fewer arrive in time."""
        out: list[Reply] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"got {len(out)} of {count} replies in {timeout}s: {out}")
            try:
                reply = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            if topic is None or reply.topic == topic:
                out.append(reply)
        return out

    def none_within(self, seconds: float) -> list[Reply]:
        """Replies that arrive within ``seconds`` (the test asserts there are none)."""
        time.sleep(seconds)
        out = []
        while not self.replies.empty():
            out.append(self.replies.get_nowait())
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def mqtt_metrics(srv: Any) -> dict[str, float]:
    """The MQTT bridge's lines of a server's /metrics page, by name (labels kept)."""
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("appliance_mqtt_"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("appliance_mqtt_")] = float(value)
    return out
