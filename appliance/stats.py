"""Per model-version statistics in Triton's shape, the one source for stats and metrics.

Only the event loop thread writes these counters (the batcher after a batch
returns, the data plane after a request ends), so no locks are needed; the
metrics endpoint and the statistics API read them on the same loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from appliance.errors import FailureReason


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
    failures: dict[FailureReason, int] = field(default_factory=dict)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    pending: int = 0  # requests queued, not yet executing
    pending_bytes: int = 0  # input bytes held by requests queued or executing (queue_bytes)
    # the copy's measured memory in Triton's shape: [{type: CPU|GPU, id, byte_size}]
    memory_usage: list[dict[str, Any]] = field(default_factory=list)
    instances: int = 0  # admitted by the memory budget
    instances_requested: int = 0  # what the config asked for

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
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def record_success(
        self, total_ns: int, queue_ns: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One request answered; compute times are those of the batch it rode in."""
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(input_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(output_ns)

    def record_failure(self, reason: FailureReason, total_ns: int) -> None:
        self.fail.add(total_ns)
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def json(self) -> dict[str, Any]:
        empty = Duration().json()
        return {
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
                "cache_hit": empty,
                "cache_miss": empty,
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
            "memory_usage": self.memory_usage,
            "pending_request_bytes": self.pending_bytes,  # ours; Triton clients ignore it
        }
