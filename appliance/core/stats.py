"""Per model-version statistics in Triton's shape, the one source for stats and metrics.

Only the event loop thread writes the model counters (the batcher after a batch
returns, the data plane after a request ends), so no locks are needed; the
metrics endpoint and the statistics API read them on the same loop. The MQTT
bridge's counters (:class:`MqttStats`) are written from paho's network thread too,
so they take a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.decoupled import TokenMeter
from appliance.errors import ApplianceError, Code, FailureReason

# the quantiles of Triton's latency summaries
QUANTILES = (0.5, 0.9, 0.95, 0.99)
LATENCY_KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# the codes a request is refused with for its own fault (the adapters answer them 4xx)
CLIENT_CODES = (Code.INVALID_ARG, Code.NOT_FOUND, Code.TOO_LARGE)


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class LatencyWindow:
    """The latencies of the last ``size`` successful requests, for Triton's summaries.

    Fixed memory (one int64 ring per kind); cumulative count and sum as Prometheus
    summaries want them; quantiles are computed at scrape time, not per request.
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._rings = np.zeros((len(LATENCY_KINDS), size), dtype=np.int64)
        self._sums = [0] * len(LATENCY_KINDS)
        self.count = 0

    def record(self, *ns: int) -> None:
        """One request's durations in nanoseconds, in the order of LATENCY_KINDS."""
        slot = self.count % self.size
        for i, value in enumerate(ns):
            us = value // 1000
            self._rings[i, slot] = us
            self._sums[i] += us
        self.count += 1

    def summary(self, kind: str) -> tuple[int, int, list[float]]:
        """(count, cumulative sum in microseconds, the QUANTILES over the window);
        quantiles are NaN before the first request, as Prometheus clients report."""
        i = LATENCY_KINDS.index(kind)
        filled = self._rings[i, : min(self.count, self.size)]
        if filled.size == 0:
            return 0, 0, [float("nan")] * len(QUANTILES)
        values = np.quantile(filled, QUANTILES)
        return self.count, self._sums[i], [float(v) for v in values]


# histogram buckets (upper bounds, seconds) of a generating model's token latencies
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """A Prometheus histogram: per-bucket counts (the last: above every bound) and
    the sum of the observations; observations come as arrays (one numpy pass)."""

    __slots__ = ("_edges_ns", "bounds", "counts", "sum_s")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._edges_ns = np.array([int(b * 1e9) for b in bounds], dtype=np.int64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.sum_s = 0.0

    def observe_ns(self, values_ns: list[int]) -> None:
        if not values_ns:
            return
        values = np.asarray(values_ns, dtype=np.int64)
        # "le" buckets: a value equal to a bound falls in that bound's bucket
        self.counts += np.bincount(
            np.searchsorted(self._edges_ns, values, side="left"), minlength=len(self.counts)
        )
        self.sum_s += float(values.sum()) / 1e9

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) per bucket, ``+Inf`` last."""
        running = np.cumsum(self.counts)
        labels = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return list(zip(labels, (int(c) for c in running), strict=True))

    @property
    def count(self) -> int:
        return int(self.counts.sum())


@dataclass(slots=True)
class TokenStats:
    """What a generating model (one that reports its tokens) produced: requests,
    prompt and generated tokens, time to first token and the gaps between tokens."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def record(self, meter: TokenMeter) -> None:
        self.requests += 1
        self.input_tokens += meter.input_tokens
        self.output_tokens += meter.output_tokens
        self.ttft.observe_ns([meter.first_ns - meter.start_ns])
        self.itl.observe_ns(meter.gaps_ns)

    def json(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "time_to_first_token_ns": int(self.ttft.sum_s * 1e9),
            "inter_token_count": self.itl.count,
            "inter_token_ns": int(self.itl.sum_s * 1e9),
        }


@dataclass(slots=True)
class ModelStats:
    """Counters of one model version; durations are cumulative nanoseconds."""

    name: str
    version: str
    inference_count: int = 0  # rows (batch items) inferred
    execution_count: int = 0  # backend calls
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    # the response cache (core/response_cache): look-ups answered, and look-ups and
    # insertions of answers the model had to compute
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    failures: dict[FailureReason, int] = field(default_factory=dict)
    # failures that were the caller's fault (4xx class: an invalid, unknown or too large
    # request), also counted in ``fail``; on the metrics page only
    # (appliance_inference_request_client_error): the OTA agent's probation leaves them out
    client_errors: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)
    pending: int = 0  # requests queued, not yet executing
    pending_bytes: int = 0  # input bytes held by requests queued or executing (queue_bytes)
    # the copy's measured memory in Triton's shape: [{type: CPU|GPU, id, byte_size}]
    memory_usage: list[dict[str, Any]] = field(default_factory=list)
    instances: int = 0  # admitted by the memory budget
    instances_requested: int = 0  # what the config asked for
    # why memory_usage is a lower bound ("": it is not); see core/warmup.lower_bound
    memory_lower_bound: str = ""
    # the latency window behind Triton's summaries; None unless the server config
    # turns summaries on (metrics_summary_latencies)
    latencies: LatencyWindow | None = None
    # tokens, for a model that reports them (a language model); None before its first
    tokens: TokenStats | None = None

    def record_tokens(self, meter: TokenMeter) -> None:
        """One generating request ended (its tokens were counted by ``meter``)."""
        if self.tokens is None:
            self.tokens = TokenStats()
        self.tokens.record(meter)

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One backend call that carried ``batch_size`` rows."""
        self.execution_count += 1
        self.inference_count += batch_size
        self.last_inference_ms = time.time_ns() // 1_000_000
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = BatchStats()
        d = b.compute_input
        d.count += 1
        d.ns += input_ns
        d = b.compute_infer
        d.count += 1
        d.ns += infer_ns
        d = b.compute_output
        d.count += 1
        d.ns += output_ns

    def record_success(
        self, total_ns: int, queue_ns: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One request answered; compute times are those of the batch it rode in
        (counters updated in place: this runs once a request, on the event loop)."""
        d = self.success
        d.count += 1
        d.ns += total_ns
        d = self.queue
        d.count += 1
        d.ns += queue_ns
        d = self.compute_input
        d.count += 1
        d.ns += input_ns
        d = self.compute_infer
        d.count += 1
        d.ns += infer_ns
        d = self.compute_output
        d.count += 1
        d.ns += output_ns
        if self.latencies is not None:
            self.latencies.record(total_ns, queue_ns, input_ns, infer_ns, output_ns)

    def record_failure(self, reason: FailureReason, total_ns: int) -> None:
        self.fail.add(total_ns)
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def record_error(self, exc: ApplianceError, total_ns: int) -> None:
        """A request that failed with ``exc``: counted by its reason, and apart when it
        was the caller's fault."""
        self.record_failure(exc.reason, total_ns)
        if exc.code in CLIENT_CODES:
            self.client_errors += 1

    def json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.json(),
                "fail": self.fail.json(),
                "queue": self.queue.json(),
                "compute_input": self.compute_input.json(),
                "compute_infer": self.compute_infer.json(),
                "compute_output": self.compute_output.json(),
                "cache_hit": self.cache_hit.json(),
                "cache_miss": self.cache_miss.json(),
            },
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.json(),
                    "compute_infer": b.compute_infer.json(),
                    "compute_output": b.compute_output.json(),
                }
                for size, b in sorted(self.batches.items())
            ],
            # Triton's ModelStatistics exactly: clients parse it strictly; what is ours
            # (pending_bytes, the memory lower bound) is on the metrics page only
            "memory_usage": self.memory_usage,
        }
        if self.tokens is not None:  # a generating model's only: others keep Triton's shape
            out["token_stats"] = self.tokens.json()
        return out


# ---- the MQTT bridge's counters ------------------------------------------------------

# name, Prometheus type, help; the metrics collector exposes them as appliance_mqtt_<name>
MQTT_METRICS = [
    ("connected", "gauge", "1 while connected to the MQTT broker"),
    ("received", "counter", "MQTT inference requests received"),
    ("answered", "counter", "MQTT requests answered with a result"),
    ("errors", "counter", "MQTT requests answered with an error"),
    ("duplicates", "counter", "MQTT redeliveries of a request already taken (not inferred)"),
    ("reconnects", "counter", "MQTT connections made after the first"),
    ("in_flight", "gauge", "MQTT requests being served now"),
]
DROP_REASONS = ("expired", "overloaded", "reply_lost", "malformed")


class MqttStats:
    """Counters of one bridge, written from the network thread and the loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(
            [name for name, _, _ in MQTT_METRICS] + [f"dropped_{r}" for r in DROP_REASONS], 0
        )

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
