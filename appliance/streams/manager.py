"""The server's camera streams: started with the server (once its models loaded),
stopped with it, and changed in place by :meth:`Streams.apply` (a config reload):
a stream whose config is unchanged keeps running, one removed or changed is stopped,
one added or changed is started. A stream whose detector's model is not loaded
keeps decoding and counts failed inferences until it is (a repository reload needs no
restart)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from appliance.config.mqtt_config import MqttConfig
from appliance.config.streams_config import StreamConfig
from appliance.streams import decoder

if TYPE_CHECKING:
    import aiohttp

    from appliance.streams import sinks
    from appliance.streams.stream import Outputs, Stream
    from appliance.vision.detector import Detectors

log = logging.getLogger(__name__)


class Streams:
    """Every running stream, by name."""

    def __init__(self, detectors: Detectors | None, mqtt: MqttConfig | None) -> None:
        self.detectors = detectors
        self.mqtt_config = mqtt
        self.running: dict[str, Stream] = {}
        self._mqtt: sinks.MqttPublisher | None = None
        self._session: aiohttp.ClientSession | None = None

    def _outputs(self, config: StreamConfig) -> Outputs:
        from appliance.streams import sinks  # (aiohttp's client, paho: with a stream only)
        from appliance.streams.stream import Outputs

        mqtt = webhook = jsonl = None
        if config.mqtt_topic and self.mqtt_config is not None:
            if self._mqtt is None:
                self._mqtt = sinks.MqttPublisher(self.mqtt_config)
                self._mqtt.start()
            mqtt = self._mqtt
        if config.webhook:
            if self._session is None:
                import aiohttp

                self._session = aiohttp.ClientSession()
            webhook = sinks.Webhook(config.webhook, self._session)
        if config.jsonl is not None:
            jsonl = sinks.JsonLines(config.jsonl, config.jsonl_max_bytes)
        return Outputs(config, mqtt, webhook, jsonl)

    async def apply(self, configs: tuple[StreamConfig, ...], detectors: Detectors | None) -> None:
        """Run exactly ``configs`` (unchanged streams keep running)."""
        wanted = {c.name: c for c in configs}
        gone = [
            s
            for name, s in self.running.items()
            if wanted.get(name) != s.config or detectors is not self.detectors
        ]
        await asyncio.gather(*(s.stop() for s in gone))
        for s in gone:
            del self.running[s.config.name]
        self.detectors = detectors
        for name, config in wanted.items():
            if name in self.running:
                continue
            if detectors is None:
                log.error("stream %s: no vision: section, nothing to run", name)
                continue
            why = decoder.available(config.decoder)
            if why:
                log.error("stream %s not started: %s", name, why)
                continue
            from appliance.streams.stream import Stream  # (with a stream only)

            stream = Stream(config, detectors.get(config.detector), self._outputs(config))
            stream.start()
            self.running[name] = stream
            log.info(
                "stream %s: %s %s -> detector %s",
                name,
                config.kind,
                stream.status()["url"],
                config.detector,
            )

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.running.values()))
        self.running.clear()
        if self._mqtt is not None:
            await asyncio.to_thread(self._mqtt.stop)
            self._mqtt = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def status(self) -> list[dict[str, Any]]:
        return [s.status() for s in self.running.values()]
