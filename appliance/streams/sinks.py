"""Where a stream's detections go: an MQTT topic on the server's broker, a webhook, a
rolling JSON-lines file. A sink never holds up inference: MQTT messages are queued by
paho (bounded), a webhook has one POST in flight per stream (a message arriving
meanwhile is dropped and counted), and a JSON line is appended on a worker thread.

Each message is one frame: ``{"stream", "timestamp" (the frame's wall-clock time,
seconds since the epoch), "frame" (its number since the stream started), "detector",
"latency_ms" (capture to publish), "predictions": [DeepStack's shape]}``."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from appliance.config.mqtt_config import MqttConfig

log = logging.getLogger(__name__)

MQTT_QUEUE = 1000  # messages paho holds while the broker is away; beyond: dropped
WEBHOOK_TIMEOUT_S = 5.0


class MqttPublisher:
    """One connection to the server's broker for every stream (paho's own thread)."""

    def __init__(self, config: MqttConfig) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

        device = config.device_id or socket.gethostname()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"{config.client_id or device}-streams",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        self.client.max_queued_messages_set(MQTT_QUEUE)
        self.client.reconnect_delay_set(1, max(1, int(config.reconnect_max_s)))
        if config.username:
            self.client.username_pw_set(config.username, config.password or None)
        if config.tls is not None:
            context = ssl.create_default_context(
                cafile=str(config.tls.ca_file) if config.tls.ca_file else None
            )
            if config.tls.cert_file is not None:
                key = str(config.tls.key_file) if config.tls.key_file else None
                context.load_cert_chain(str(config.tls.cert_file), key)
            self.client.tls_set_context(context)
        self.config = config
        self.dropped = 0

    def start(self) -> None:
        self.client.connect_async(self.config.host, self.config.port, self.config.keepalive_s)
        self.client.loop_start()

    def publish(self, topic: str, payload: bytes) -> bool:
        info = self.client.publish(topic, payload, qos=0)
        if info.rc != 0:  # the queue is full (the broker is away)
            self.dropped += 1
            return False
        return True

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Webhook:
    """POSTs to one URL, one at a time."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session
        self._task: asyncio.Task[None] | None = None
        self.sent = self.failed = self.dropped = 0

    def post(self, body: bytes) -> bool:
        if self._task is not None and not self._task.done():
            self.dropped += 1
            return False
        self._task = asyncio.get_running_loop().create_task(self._send(body))
        return True

    async def _send(self, body: bytes) -> None:
        timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S)
        headers = {"Content-Type": "application/json"}
        try:
            async with self.session.post(
                self.url, data=body, headers=headers, timeout=timeout
            ) as answer:
                await answer.read()
                if answer.status >= 400:
                    raise aiohttp.ClientResponseError(
                        answer.request_info, (), status=answer.status, message=answer.reason or ""
                    )
            self.sent += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.failed += 1
            log.debug("webhook %s: %s", self.url, exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class JsonLines:
    """Appends lines to ``path``; past ``max_bytes`` it becomes ``path.1`` (the one
    before is dropped) and a new file starts."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._file: Any = None
        self._lock = asyncio.Lock()

    def _write(self, line: bytes) -> None:
        if self._file is None:
            self._file = open(self.path, "ab")  # noqa: SIM115 (kept open between lines)
        if self._file.tell() + len(line) > self.max_bytes and self._file.tell() > 0:
            self._file.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._file = open(self.path, "ab")  # noqa: SIM115
        self._file.write(line)
        self._file.flush()

    async def write(self, line: bytes) -> None:
        async with self._lock:
            await asyncio.to_thread(self._write, line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def message(
    stream: str, detector: str, number: int, wall: float, latency_s: float, predictions: list[Any]
) -> bytes:
    return orjson.dumps(
        {
            "stream": stream,
            "timestamp": wall,
            "frame": number,
            "detector": detector,
            "latency_ms": round(latency_s * 1000, 2),
            "predictions": predictions,
        }
    )
