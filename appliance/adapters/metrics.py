"""Prometheus metrics with Triton's names and labels, exposed through prometheus-client.

One custom collector reads, at scrape time, the same :class:`ModelStats` counters the
statistics API reports (and the MQTT bridge's and the memory budget's figures), so the
two can never disagree and the inference hot path pays for one set of integer
additions only. prometheus-client does the exposition: escaping, the text format and
OpenMetrics by content negotiation, and the standard ``process_*`` metrics.

Names: Triton's counters carry no ``_total`` suffix (``nv_inference_request_success``).
prometheus-client appends ``_total`` to anything typed *counter*, so those counters are
exposed as *untyped* (OpenMetrics: *unknown*) under their exact Triton names; rate() and
increase() treat them the same, and Triton dashboards work unchanged.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from appliance.core.stats import DROP_REASONS, MQTT_METRICS, QUANTILES, ModelStats
from appliance.errors import FailureReason
from appliance.telemetry.families import Family, Sample

# name, help, value of one ModelStats (Triton's cumulative counters)
_COUNTERS: list[tuple[str, str, Callable[[ModelStats], int]]] = [
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds",
        lambda s: s.compute_output.ns // 1000,
    ),
    (
        "nv_cache_num_hits_per_model",
        "Number of cache hits per model",
        lambda s: s.cache_hit.count,
    ),
    (
        "nv_cache_num_misses_per_model",
        "Number of cache misses per model",
        lambda s: s.cache_miss.count,
    ),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        lambda s: s.cache_hit.ns // 1000,
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insertion) duration per model, in microseconds",
        lambda s: s.cache_miss.ns // 1000,
    ),
]

# Triton's latency summaries (`--metrics-config summary_latencies=true`): name, help,
# which window of ModelStats.latencies
_SUMMARIES = [
    (
        "nv_inference_request_summary_us",
        "Summary of inference request duration in microseconds",
        "request",
    ),
    (
        "nv_inference_queue_summary_us",
        "Summary of inference queuing duration in microseconds",
        "queue",
    ),
    (
        "nv_inference_compute_input_summary_us",
        "Summary of compute input duration in microseconds",
        "compute_input",
    ),
    (
        "nv_inference_compute_infer_summary_us",
        "Summary of compute inference duration in microseconds",
        "compute_infer",
    ),
    (
        "nv_inference_compute_output_summary_us",
        "Summary of compute output duration in microseconds",
        "compute_output",
    ),
]


def process_memory() -> tuple[int, int, int]:
    """(this process's resident bytes, system used bytes, system total bytes)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * page
        info: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        total = info["MemTotal"]
        return rss, total - info.get("MemAvailable", info.get("MemFree", 0)), total
    except (OSError, KeyError, ValueError, IndexError):  # not Linux: peak RSS is what we have
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = page * os.sysconf("SC_PHYS_PAGES")
        return rss, 0, total


@dataclass
class Sources:
    """Where the collector reads at scrape time; each a cheap call on the event loop."""

    models: Callable[[], Iterable[ModelStats]]
    budget: Callable[[], tuple[int | None, int] | None] = lambda: None
    mqtt: Callable[[], dict[str, int] | None] = lambda: None
    # (bytes held by queued requests, the server-wide limit)
    queued: Callable[[], tuple[int, int] | None] = lambda: None
    # the device's temperatures, clocks, power and throttling (appliance.telemetry)
    telemetry: Callable[[], Iterable[Sample]] = lambda: ()


def _untyped(name: str, help_text: str) -> Metric:
    return Metric(name, help_text, "unknown")


class ApplianceCollector(Collector):
    """Turns the server's counters into metric families, once per scrape."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        stats = list(self.sources.models())
        yield from self._model_families(stats)
        yield from self._summaries(stats)
        yield from self._memory(stats)
        yield from self._tokens(stats)
        mqtt = self.sources.mqtt()
        if mqtt is not None:
            yield from self._mqtt(mqtt)
        yield from self._telemetry(self.sources.telemetry())

    def _model_families(self, stats: list[ModelStats]) -> Iterator[Metric]:
        for name, help_text, value in _COUNTERS:
            family = _untyped(name, help_text)
            for s in stats:
                family.add_sample(name, {"model": s.name, "version": s.version}, value(s))
            yield family
            if name == "nv_inference_request_success":
                failure = "nv_inference_request_failure"
                family = _untyped(failure, "Number of failed inference requests, all batch sizes")
                for s in stats:
                    for reason in FailureReason:
                        labels = {"model": s.name, "reason": reason.value, "version": s.version}
                        family.add_sample(failure, labels, s.failures.get(reason, 0))
                yield family
                client = "appliance_inference_request_client_error"
                family = _untyped(
                    client,
                    "Failed inference requests that were the caller's "
                    "fault (invalid, unknown or too large), of the failures above",
                )
                for s in stats:
                    family.add_sample(client, {"model": s.name, "version": s.version},
                                      s.client_errors)  # fmt: skip
                yield family
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=["model", "version"],
        )
        held = GaugeMetricFamily(
            "nv_inference_pending_request_bytes",
            "Instantaneous bytes of input tensors held by requests queued or executing "
            "per-model (appliance; bounded by max_queued_bytes_per_model).",
            labels=["model", "version"],
        )
        for s in stats:
            pending.add_metric([s.name, s.version], s.pending)
            held.add_metric([s.name, s.version], s.pending_bytes)
        yield pending
        yield held
        queued = self.sources.queued()
        if queued is not None:
            held_total, limit = queued
            yield GaugeMetricFamily(
                "appliance_queued_bytes",
                "Bytes of input tensors held by all queued or executing requests",
                value=held_total,
            )
            yield GaugeMetricFamily(
                "appliance_queued_bytes_limit",
                "The server-wide bound on queued bytes (max_queued_bytes)",
                value=limit,
            )

    def _summaries(self, stats: list[ModelStats]) -> Iterator[Metric]:
        timed = [s for s in stats if s.latencies is not None]
        if not timed:
            return
        for name, help_text, which in _SUMMARIES:
            family = Metric(name, help_text, "summary")
            for s in timed:
                assert s.latencies is not None
                labels = {"model": s.name, "version": s.version}
                count, total_us, quantiles = s.latencies.summary(which)
                for q, value in zip(QUANTILES, quantiles, strict=True):
                    family.add_sample(name, {**labels, "quantile": str(q)}, value)
                family.add_sample(name + "_count", labels, count)
                family.add_sample(name + "_sum", labels, total_us)
            yield family

    def _tokens(self, stats: list[ModelStats]) -> Iterator[Metric]:
        """A generating model's token figures (absent until one generated tokens):
        time to first token and inter-token latency as histograms in seconds, prompt
        and generated tokens as counters (output tokens per second: their rate())."""
        generating = [s for s in stats if s.tokens is not None]
        if not generating:
            return
        labels = ["model", "version"]
        for name, help_text, which in (
            (
                "appliance_llm_time_to_first_token_seconds",
                "Time from a generate request's arrival to its first generated token",
                "ttft",
            ),
            (
                "appliance_llm_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request",
                "itl",
            ),
        ):
            family = HistogramMetricFamily(name, help_text, labels=labels)
            for s in generating:
                assert s.tokens is not None
                histogram = s.tokens.ttft if which == "ttft" else s.tokens.itl
                family.add_metric([s.name, s.version], histogram.cumulative(), histogram.sum_s)
            yield family
        for name, help_text, attr in (
            ("appliance_llm_output_tokens", "Tokens generated", "output_tokens"),
            ("appliance_llm_input_tokens", "Prompt tokens of generate requests", "input_tokens"),
            ("appliance_llm_requests", "Generate requests that produced tokens", "requests"),
        ):
            counter = CounterMetricFamily(name, help_text, labels=labels)
            for s in generating:
                counter.add_metric([s.name, s.version], getattr(s.tokens, attr))
            yield counter

    def _memory(self, stats: list[ModelStats]) -> Iterator[Metric]:
        _, used, total = process_memory()
        yield GaugeMetricFamily(
            "nv_cpu_memory_used_bytes", "CPU (system) memory used in bytes", value=used
        )
        yield GaugeMetricFamily(
            "nv_cpu_memory_total_bytes", "CPU (system) memory total in bytes", value=total
        )
        memory = GaugeMetricFamily(
            "appliance_model_memory_bytes",
            "Measured memory of a loaded model version",
            labels=["model", "type", "version"],
        )
        for s in stats:
            for row in s.memory_usage:
                memory.add_metric([s.name, str(row["type"]), s.version], row["byte_size"])
        yield memory
        for name, help_text, attr in (
            ("appliance_model_instances", "Instances admitted by the memory budget", "instances"),
            (
                "appliance_model_instances_requested",
                "Instances the model config asks for",
                "instances_requested",
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["model", "version"])
            for s in stats:
                family.add_metric([s.name, s.version], getattr(s, attr))
            yield family
        lower = GaugeMetricFamily(
            "appliance_model_memory_lower_bound",
            "1 when a model version's measured memory is a lower bound "
            "(dynamic dims measured at 1, or its warm-up failed): declare a model_warmup",
            labels=["model", "version"],
        )
        for s in stats:
            lower.add_metric([s.name, s.version], 1 if s.memory_lower_bound else 0)
        yield lower
        budget = self.sources.budget()
        if budget is not None:
            limit, used_by_models = budget
            yield GaugeMetricFamily(
                "appliance_memory_budget_bytes",
                "Memory budget for loaded models (-1: unlimited)",
                value=-1 if limit is None else limit,
            )
            yield GaugeMetricFamily(
                "appliance_memory_budget_used_bytes",
                "Memory the loaded models use",
                value=used_by_models,
            )

    def _mqtt(self, values: dict[str, int]) -> Iterator[Metric]:
        for name, kind, help_text in MQTT_METRICS:
            metric = f"appliance_mqtt_{name}"
            if kind == "gauge":
                yield GaugeMetricFamily(metric, help_text, value=values[name])
            else:
                family = _untyped(metric, help_text)
                family.add_sample(metric, {}, values[name])
                yield family
        metric = "appliance_mqtt_dropped"
        family = _untyped(
            metric,
            "MQTT requests not inferred: expired, overloaded (answered with an error), "
            "or whose reply was lost",
        )
        for reason in DROP_REASONS:
            family.add_sample(metric, {"reason": reason}, values[f"dropped_{reason}"])
        yield family

    def _telemetry(self, samples: Iterable[Sample]) -> Iterator[Metric]:
        """One family per kind of reading found; a family with no samples is absent."""
        by_family: dict[Family, list[Sample]] = {}
        for sample in samples:
            by_family.setdefault(sample.family, []).append(sample)
        for family, rows in by_family.items():
            metric: GaugeMetricFamily | CounterMetricFamily
            if family.kind == "counter":  # prometheus-client appends _total
                metric = CounterMetricFamily(family.name, family.help, labels=family.labels)
            else:
                metric = GaugeMetricFamily(family.name, family.help, labels=family.labels)
            for row in rows:
                metric.add_metric(row.labels, row.value)
            yield metric


class MetricsExporter:
    """A registry holding the appliance collector and the standard process metrics."""

    def __init__(self, sources: Sources) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ApplianceCollector(sources))
        self.registry.register(ProcessCollector(registry=None))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The page and its content type, negotiated from an Accept header (OpenMetrics
        when the scraper asks for it, the Prometheus text format otherwise)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
