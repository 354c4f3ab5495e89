"""What device telemetry adds to a /metrics scrape.

A benchmark, not a test. It renders the metrics page the way the server does (the
appliance's collector with a loaded model's statistics, plus prometheus-client's
process metrics) with and without the device telemetry source, and times the
telemetry reading alone, for:

- ``this machine``: whatever :meth:`Telemetry.discover` finds under ``/`` here;
- the recorded trees of a Jetson Orin Nano and an x86 box (tests/telemetry/trees):
  the same number of files as on those devices, read from the page cache, so the
  figure is the Python side of the cost. On a real Jetson each INA3221 attribute is
  an I2C transfer in the driver; run this there with ``--root /`` for that figure.

Each case renders ``--renders`` pages after a warm-up and reports the median and the
90th percentile per page. Results are printed as markdown and written to
``benchmarks/results/<date>-telemetry.md`` with the machine and its load average.

    python benchmarks/bench_telemetry.py [--renders 2000] [--root /]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py, next to this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.adapters.metrics import MetricsExporter, Sources  # noqa: E402
from appliance.core.stats import ModelStats  # noqa: E402
from appliance.telemetry.device import Telemetry  # noqa: E402

TREES = ROOT / "tests" / "telemetry" / "trees"


def _time(fn, n: int) -> tuple[float, float]:
    for _ in range(min(200, n)):
        fn()
    took = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        took.append(time.perf_counter_ns() - t0)
    took.sort()
    return statistics.median(took) / 1000, took[int(len(took) * 0.9)] / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=2000)
    parser.add_argument("--root", default="/", help="where 'this machine' looks (default /)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stats = [ModelStats("simple", "1"), ModelStats("classifier", "1")]
    cases = [("this machine", Telemetry.discover(args.root))]
    cases += [
        (name, Telemetry.discover(str(TREES / name), libraries=False))
        for name in ("jetson-orin-nano", "x86-intel")
    ]
    plain = MetricsExporter(Sources(models=lambda: stats))
    base_med, base_p90 = _time(plain.render, args.renders)
    rows = [("without telemetry", "-", 0, base_med, base_p90, 0.0, 0.0)]
    for name, telemetry in cases:
        exporter = MetricsExporter(Sources(models=lambda: stats, telemetry=telemetry.read))
        med, p90 = _time(exporter.render, args.renders)
        read_med, read_p90 = _time(telemetry.read, args.renders)
        rows.append((name, str(len(telemetry.sources)), len(telemetry.read()), med, p90,
                     read_med, read_p90))  # fmt: skip
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# Device telemetry: scrape cost ({datetime.date.today()})",
        "",
        f"Command: `python benchmarks/bench_telemetry.py --renders {args.renders}"
        f" --root {args.root}`",
        "",
        f"`uptime` before the run: `{uptime}`",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in describe("prometheus-client").items()),
        "",
        "| case | sources | samples | page median us | page p90 us | added median us |"
        " telemetry read median us | read p90 us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, sources, samples, med, p90, rmed, rp90 in rows:
        added = med - base_med
        lines.append(
            f"| {name} | {sources} | {samples} | {med:.0f} | {p90:.0f} | {added:+.0f} |"
            f" {rmed:.0f} | {rp90:.0f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    out = args.out or ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-telemetry.md"
    out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
