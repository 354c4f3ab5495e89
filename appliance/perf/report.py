"""Results of ``appliance perf``: the live table, CSV, JSON and an optional PNG plot.

CSV has one row per point with fixed columns (errors by kind as a JSON object in
one column); JSON holds the run's settings, the machine and every point. The
plot (latency p50/p99 against throughput) is drawn only when matplotlib is
installed: it is not a dependency of the appliance.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from appliance.perf.runner import Point

COLUMNS = [f.name for f in dataclasses.fields(Point)]
_TABLE = (
    ("point", 10, lambda p: p.label),
    ("infer/s", 10, lambda p: f"{p.throughput_infer_s:.1f}"),
    ("p50 ms", 8, lambda p: f"{p.p50_ms:.2f}"),
    ("p90 ms", 8, lambda p: f"{p.p90_ms:.2f}"),
    ("p99 ms", 8, lambda p: f"{p.p99_ms:.2f}"),
    ("queue us", 9, lambda p: f"{p.server_queue_us:.0f}"),
    ("infer us", 9, lambda p: f"{p.server_compute_infer_us:.0f}"),
    ("batch", 6, lambda p: f"{p.server_avg_batch:.1f}"),
    ("cli us/r", 9, lambda p: f"{p.client_cpu_us_per_req:.0f}"),
    ("errors", 7, lambda p: str(p.errors)),
    ("throttled", 9, lambda p: "-" if p.throttled is None else ("yes" if p.throttled else "no")),
)


def machine() -> dict[str, Any]:
    """Where the figures were measured (the benchmarks record it next to each figure)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


class LiveTable:
    """Prints the table header, a progress line while a point runs, a row per point."""

    def __init__(self, out: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.out, self.quiet = out, quiet
        self.tty = out.isatty()
        self._started = False

    def _header(self) -> None:
        if not self._started:
            self._started = True
            self.out.write(" ".join(f"{h:>{w}}" for h, w, _ in _TABLE) + "\n")

    def progress(self, label: str, fraction: float) -> None:
        if self.quiet or not self.tty:
            return
        self._header()
        bar = "#" * int(fraction * 20)
        self.out.write(f"\r{label:>10} [{bar:<20}] {fraction * 100:3.0f}%")
        self.out.flush()

    def row(self, p: Point) -> None:
        if self.quiet:
            return
        self._header()
        if self.tty:
            self.out.write("\r\x1b[K")
        self.out.write(" ".join(f"{fn(p):>{w}}" for _, w, fn in _TABLE) + "\n")
        for kind, n in list(p.errors_by_kind.items())[:3]:
            self.out.write(f"{'':>10}   {n} x {kind}\n")
        self.out.flush()


def throttle_warning(points: Sequence[Point]) -> str | None:
    """One line naming the points during which the device throttled (None if none)."""
    hit = [p for p in points if p.throttled]
    if not hit:
        return None
    where = ", ".join(f"{p.label} ({p.throttle_reasons})" for p in hit)
    return f"the device throttled during {where}: those figures are below what it does cool"


def to_csv(points: Sequence[Point]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for p in points:
        row = dataclasses.asdict(p)
        row["errors_by_kind"] = orjson.dumps(p.errors_by_kind).decode()
        writer.writerow(row)
    return buf.getvalue()


def to_json(points: Sequence[Point], settings: dict[str, Any]) -> bytes:
    doc = {
        "settings": settings,
        "machine": machine(),
        "points": [dataclasses.asdict(p) for p in points],
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def plot(points: Sequence[Point], path: Path, title: str) -> bool:
    """A latency-throughput PNG; False when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib  # optional: only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [p.throughput_infer_s for p in points]
    for attr, name in (("p50_ms", "p50"), ("p99_ms", "p99")):
        ax.plot(x, [getattr(p, attr) for p in points], marker="o", label=name)
    for p in points:
        ax.annotate(p.label, (p.throughput_infer_s, p.p99_ms), fontsize=7)
    ax.set_xlabel("throughput (infer/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
