"""Prometheus text exposition with Triton's metric names and labels.

Rendered at scrape time from the same :class:`ModelStats` counters the
statistics API reports, so the two can never disagree and the inference hot
path pays for one set of integer additions only. Names carry no ``_total``
suffix, exactly as Triton exposes them, so existing dashboards work.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable

from appliance.errors import FailureReason
from appliance.stats import ModelStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, help, type, value of one ModelStats
_MODEL_METRICS: list[tuple[str, str, str, Callable[[ModelStats], int]]] = [
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        "counter",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        "counter",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed",
        "counter",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_pending_request_count",
        "Instantaneous number of pending requests awaiting execution per-model.",
        "gauge",
        lambda s: s.pending,
    ),
    (
        "nv_inference_pending_request_bytes",
        "Instantaneous bytes of input tensors held by requests queued or executing per-model "
        "(appliance; bounded by max_queued_bytes).",
        "gauge",
        lambda s: s.pending_bytes,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        "counter",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        "counter",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        "counter",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        "counter",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds",
        "counter",
        lambda s: s.compute_output.ns // 1000,
    ),
]


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


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


def _memory_lines(stats: list[ModelStats], budget: tuple[int | None, int] | None) -> list[str]:
    """Per model-version memory and instances, and the budget (limit -1: unlimited)."""
    lines = [
        "# HELP appliance_model_memory_bytes Measured memory of a loaded model version",
        "# TYPE appliance_model_memory_bytes gauge",
    ]
    for s in stats:
        for row in s.memory_usage:
            lines.append(
                f'appliance_model_memory_bytes{{model="{_label(s.name)}",type="{row["type"]}",'
                f'version="{s.version}"}} {row["byte_size"]}'
            )
    for name, help_text, attr in (
        ("appliance_model_instances", "Instances admitted by the memory budget", "instances"),
        (
            "appliance_model_instances_requested",
            "Instances the model config asks for",
            "instances_requested",
        ),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for s in stats:
            lines.append(
                f'{name}{{model="{_label(s.name)}",version="{s.version}"}} {getattr(s, attr)}'
            )
    if budget is not None:
        limit, used = budget
        for name, help_text, amount in (
            (
                "appliance_memory_budget_bytes",
                "Memory budget for loaded models (-1: unlimited)",
                -1 if limit is None else limit,
            ),
            ("appliance_memory_budget_used_bytes", "Memory the loaded models use", used),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {amount}"]
    return lines


def render(stats: Iterable[ModelStats], budget: tuple[int | None, int] | None = None) -> str:
    """The /metrics page for the given model versions plus process memory and, when
    given, the memory budget as (limit or None, used)."""
    stats = list(stats)
    lines: list[str] = []
    for name, help_text, kind, value in _MODEL_METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for s in stats:
            lines.append(f'{name}{{model="{_label(s.name)}",version="{s.version}"}} {value(s)}')
        if name == "nv_inference_request_success":
            failure = "nv_inference_request_failure"
            lines.append(f"# HELP {failure} Number of failed inference requests, all batch sizes")
            lines.append(f"# TYPE {failure} counter")
            for s in stats:
                for reason in FailureReason:
                    lines.append(
                        f'{failure}{{model="{_label(s.name)}",reason="{reason.value}",'
                        f'version="{s.version}"}} {s.failures.get(reason, 0)}'
                    )
    rss, used, total = process_memory()
    for name, help_text, amount in [
        (
            "process_resident_memory_bytes",
            "Resident memory size of the server process in bytes",
            rss,
        ),
        ("nv_cpu_memory_used_bytes", "CPU (system) memory used in bytes", used),
        ("nv_cpu_memory_total_bytes", "CPU (system) memory total in bytes", total),
    ]:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {amount}"]
    lines += _memory_lines(stats, budget)
    return "\n".join(lines) + "\n"
