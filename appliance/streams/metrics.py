"""The streams' Prometheus families, read at each scrape from the running streams
(registered beside the appliance collector by the server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from appliance.streams.stream import Stream

OUTCOMES = ("decoded", "skipped", "dropped", "inferred", "failed", "published")


class StreamsCollector(Collector):
    def __init__(self, streams: Callable[[], list[Stream]]) -> None:
        self.streams = streams

    def collect(self) -> Iterator[Any]:
        streams = self.streams()
        if not streams:
            return
        frames = CounterMetricFamily(
            "appliance_stream_frames",
            "Camera frames by outcome: decoded (kept for inference), skipped (above the "
            "stream's fps), dropped (replaced by a newer frame before inference), inferred, "
            "failed (the inference raised), published",
            labels=["stream", "outcome"],
        )
        connected = GaugeMetricFamily(
            "appliance_stream_connected",
            "1 while the stream's source delivers frames",
            labels=["stream"],
        )
        reconnects = CounterMetricFamily(
            "appliance_stream_disconnects", "Times the stream's source was lost", labels=["stream"]
        )
        decode = SummaryMetricFamily(
            "appliance_stream_decode_seconds",
            "Decoding a kept frame (packet to RGB)",
            labels=["stream"],
        )
        e2e = SummaryMetricFamily(
            "appliance_stream_latency_seconds",
            "A frame from decoded to its detections published",
            labels=["stream"],
        )
        for s in streams:
            c, name = s.counters, s.config.name
            for outcome in OUTCOMES:
                frames.add_metric([name, outcome], getattr(c, outcome))
            connected.add_metric([name], 1 if s.connected else 0)
            reconnects.add_metric([name], c.disconnects)
            decode.add_metric([name], c.decoded, c.decode_seconds)
            e2e.add_metric([name], c.published, c.e2e_seconds)
        yield from (frames, connected, reconnects, decode, e2e)
