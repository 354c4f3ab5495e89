"""One camera stream: a decoder thread that keeps the newest frame, and a task on the
event loop that infers it and hands the detections to the sinks.

**Latest frame wins.** The thread puts each frame it keeps in a one-frame slot; a frame
still there when the next arrives is replaced and counted as dropped. So at most one
frame waits and one is inferred per stream, whatever the model's speed: memory is
flat and a published detection is never older than one inference plus one frame. The
frames of every stream go through the data plane as separate requests, so the
detector's scheduler batches them (four cameras share one batch).

**Rate.** A live source is read at its own pace and frames arriving sooner than
``1/fps`` after the last kept one are skipped (decoded, never converted); a file is
read at ``fps``.

**Reconnect with backoff.** A source that fails to open or breaks (a timeout, a
closed connection, a broken stream) is closed and opened again after
``reconnect_min_s``, doubling up to ``reconnect_max_s``; a frame received resets it.
The thread waits on its own: a dead camera never blocks another stream or the
server."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.config.streams_config import StreamConfig
from appliance.errors import ApplianceError
from appliance.streams import decoder, sinks
from appliance.vision.detector import Detector

log = logging.getLogger(__name__)

WINDOW = 512  # latencies kept for the status percentiles


@dataclass(slots=True)
class Frame:
    rgb: np.ndarray
    number: int
    wall: float  # time.time() when it was decoded
    captured: float  # time.monotonic() then


@dataclass(slots=True)
class Counters:
    decoded: int = 0  # frames converted and offered for inference
    skipped: int = 0  # frames decoded but not kept (the rate)
    dropped: int = 0  # frames replaced in the slot before inference took them
    inferred: int = 0
    failed: int = 0  # inferences that raised (model not loaded, overloaded...)
    published: int = 0
    connects: int = 0
    disconnects: int = 0
    decode_seconds: float = 0.0  # summed over decoded frames
    e2e_seconds: float = 0.0  # decoded -> published, summed over published frames


class Stream:
    """One configured stream; :meth:`start` and :meth:`stop` on the event loop."""

    def __init__(self, config: StreamConfig, detector: Detector, outputs: Outputs) -> None:
        self.config = config
        self.detector = detector
        self.outputs = outputs
        self.counters = Counters()
        self.connected = False
        self.last_error = ""
        self.e2e: deque[float] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self._slot: Frame | None = None
        self._stopping = threading.Event()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    # ---- the decoder thread -------------------------------------------------------

    def _offer(self, frame: Frame) -> None:
        with self._lock:
            empty = self._slot is None
            if not empty:
                self.counters.dropped += 1
            self._slot = frame
        if empty and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _read(self, source: decoder.Source) -> bool:
        """Frames until the source ends (True) or stopping (False)."""
        c, interval = self.config, 1.0 / self.config.fps
        due = time.monotonic()
        for raw, spent in source.frames():
            if self._stopping.is_set():
                return False
            now = time.monotonic()
            if c.kind == "file":
                if self._stopping.wait(max(0.0, due - now)):
                    return False
            elif now < due:
                self.counters.skipped += 1
                continue
            due = max(due + interval, time.monotonic() - interval)
            started = time.perf_counter()
            rgb = source.rgb(raw)
            self.counters.decode_seconds += spent + time.perf_counter() - started
            self.counters.decoded += 1
            self._offer(Frame(rgb, self.counters.decoded, time.time(), time.monotonic()))
            if not self.connected:
                self.connected = True
                self.counters.connects += 1
        return True

    def _decode(self) -> None:
        c = self.config
        backoff = c.reconnect_min_s
        opener = decoder.DECODERS[c.decoder]
        while not self._stopping.is_set():
            source: decoder.Source | None = None
            ended, decoded = False, self.counters.decoded
            try:
                source = opener(c)
                ended = self._read(source)
                if ended and c.kind == "file" and not c.loop:
                    log.info("stream %s: %s played once, done", c.name, c.url)
                    return
                if ended and c.kind != "file":
                    self.last_error = "the source closed the stream"
            except Exception as exc:  # PyAV's errors, OSError, a broken stream
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("stream %s: %s", c.name, self.last_error)
            finally:
                if source is not None:
                    try:
                        source.close()
                    except Exception as exc:  # closing a broken container
                        log.debug("stream %s: close: %s", c.name, exc)
                if self.connected:
                    self.connected = False
                    self.counters.disconnects += 1
                    backoff = c.reconnect_min_s  # it worked: start the backoff again
            if ended and c.kind == "file" and self.counters.decoded > decoded:
                continue  # looped: from the start, at once (a file without frames waits)
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, c.reconnect_max_s)

    # ---- the event loop ---------------------------------------------------------------

    def _take(self) -> Frame | None:
        with self._lock:
            frame, self._slot = self._slot, None
        return frame

    async def _infer(self) -> None:
        c = self.config
        while True:
            await self._wake.wait()
            self._wake.clear()
            frame = self._take()
            if frame is None:
                continue
            try:
                predictions = await self.detector.detect(frame.rgb, c.min_confidence)
            except ApplianceError as exc:  # not loaded yet, reloading, overloaded
                self.counters.failed += 1
                self.last_error = exc.message
                await asyncio.sleep(min(1.0, 1.0 / c.fps))
                continue
            self.counters.inferred += 1
            if c.only_detections and not predictions:
                continue
            latency = time.monotonic() - frame.captured
            body = sinks.message(c.name, c.detector, frame.number, frame.wall, latency, predictions)
            await self.outputs.send(body)
            self.counters.published += 1
            self.counters.e2e_seconds += latency
            self.e2e.append(latency)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._infer(), name=f"stream:{self.config.name}")
        self._thread = threading.Thread(
            target=self._decode, name=f"stream-{self.config.name}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:  # a read returns within open_timeout_s
            await asyncio.to_thread(self._thread.join, self.config.open_timeout_s + 5)
        await self.outputs.close()

    def status(self) -> dict[str, Any]:
        c = self.counters
        e2e = sorted(self.e2e)

        def pct(q: float) -> float | None:
            return round(e2e[min(len(e2e) - 1, int(q * len(e2e)))] * 1000, 2) if e2e else None

        return {
            "name": self.config.name,
            "url": _redacted(self.config.url),
            "connected": self.connected,
            "frames_decoded": c.decoded,
            "frames_skipped": c.skipped,
            "frames_dropped": c.dropped,
            "frames_inferred": c.inferred,
            "frames_failed": c.failed,
            "frames_published": c.published,
            "connects": c.connects,
            "disconnects": c.disconnects,
            "decode_ms_mean": round(c.decode_seconds / c.decoded * 1000, 2) if c.decoded else None,
            "e2e_ms_p50": pct(0.5),
            "e2e_ms_p99": pct(0.99),
            "last_error": self.last_error,
            "sinks": self.outputs.status(),
        }


def _redacted(url: str) -> str:
    """A camera URL without its password (rtsp://user:secret@host/...)."""
    head, at, tail = url.rpartition("@")
    if not at or "://" not in head:
        return url
    scheme, _, credentials = head.partition("://")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"


class Outputs:
    """A stream's sinks."""

    def __init__(
        self,
        config: StreamConfig,
        mqtt: sinks.MqttPublisher | None,
        webhook: sinks.Webhook | None,
        jsonl: sinks.JsonLines | None,
    ) -> None:
        self.topic = config.mqtt_topic
        self.mqtt, self.webhook, self.jsonl = mqtt, webhook, jsonl

    async def send(self, body: bytes) -> None:
        if self.mqtt is not None:
            self.mqtt.publish(self.topic, body)
        if self.webhook is not None:
            self.webhook.post(body)
        if self.jsonl is not None:
            await self.jsonl.write(body + b"\n")

    def status(self) -> dict[str, Any]:
        """What each sink did: a webhook's posts sent, failed and dropped (one was in
        flight), MQTT messages paho could not queue (all streams' together)."""
        out: dict[str, Any] = {}
        if self.webhook is not None:
            w = self.webhook
            out["webhook"] = {"sent": w.sent, "failed": w.failed, "dropped": w.dropped}
        if self.mqtt is not None:
            out["mqtt"] = {"topic": self.topic, "dropped": self.mqtt.dropped}
        if self.jsonl is not None:
            out["jsonl"] = {"path": str(self.jsonl.path)}
        return out

    async def close(self) -> None:
        if self.webhook is not None:
            await self.webhook.close()
        if self.jsonl is not None:
            self.jsonl.close()
