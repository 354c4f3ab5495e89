"""ONNX Runtime vs OpenVINO on the same ONNX models, in-process, on this machine's CPU.

A benchmark, not a test. Both engines run through the appliance's own backend
classes with the options the server would give them (threads = the instance's share
of the usable cores; OpenVINO: LATENCY hint for one instance, THROUGHPUT with one
compiled model for two), on ``devtools.modelgen.classifier()`` (FP32 CNN,
[-1,3,224,224] -> [-1,1000]) and ``mlp()`` ([-1,256] -> [-1,16]).

For each model and engine:

- load: seconds to create one instance (read + compile) and its first inference;
- memory: RSS growth of one loaded, warmed-up instance, measured in a fresh
  subprocess after the engine's libraries were loaded with a tiny model, with freed
  heap handed back to the OS (glibc ``malloc_trim``) before each reading;
- latency: one instance, all usable cores, batch 1, back to back: p50 / p99 ms;
- batched: one instance, all cores, a batch of ``--batch`` rows: rows/s;
- 2 instances: two instances on their own threads (one core's share each), batch 1,
  both at once: rows/s in total.

Engines alternate and every measurement is repeated ``--rounds`` times; the report
gives the median and the range. A measurement during which other processes took
more than ``--quiet-budget`` of the CPU is taken again (``--retries``); the "other
CPU" column is the worst share others took in that row's kept measurements. The
report ends with the geometric mean of OpenVINO's speed relative to ONNX Runtime and
the engine that figure favours.

    python3 benchmarks/bench_backends.py [--seconds 2] [--rounds 3] [--out FILE]
        [--quiet-budget 0.10] [--retries 3]

Results are printed as markdown and written to ``benchmarks/results/<date>-backends.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout: devtools/ is not installed

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)

from appliance import backends  # noqa: E402
from appliance.backends.base import Backend, BackendOptions  # noqa: E402
from appliance.core.instances import cpu_share  # noqa: E402
from devtools import modelgen  # noqa: E402

ENGINES = ("onnxruntime", "openvino")
MODELS: dict[str, tuple[Callable[[], bytes], tuple[int, ...], int]] = {
    # name: (builder, one row's shape, rows in the batched case)
    "classifier": (modelgen.classifier, (3, 224, 224), 8),
    "mlp": (modelgen.mlp, (256,), 64),
}
CORES = len(os.sched_getaffinity(0))


def log(message: str) -> None:
    print(f"[bench_backends] {message}", file=sys.stderr, flush=True)


def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def create(engine: str, path: Path, index: int = 0, count: int = 1) -> Backend:
    return backends.create(
        engine,
        BackendOptions(
            path,
            instance_index=index,
            instance_count=count,
            threads=cpu_share(count),
            share_group=f"bench:{path}:{count}",
        ),
    )


def run_for(seconds: float, call: Callable[[], object]) -> list[float]:
    """Call back to back for ``seconds``; per-call latencies in seconds."""
    out = []
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        out.append(t1 - t0)
        if t1 >= deadline:
            return out


def busy_seconds() -> float:
    """CPU seconds all processes spent busy so far (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


T = TypeVar("T")


def quietly(measure: Callable[[], T], retries: int, budget: float) -> tuple[T, float]:
    """Run ``measure``; while other processes took more than ``budget`` of the machine's
    CPU meanwhile, run it again (up to ``retries`` more times). Returns the least
    disturbed result and the share of the CPU that others took during it."""
    best: tuple[T, float] | None = None
    for _ in range(retries + 1):
        busy, own, t0 = busy_seconds(), own_seconds(), time.perf_counter()
        value = measure()
        elapsed = time.perf_counter() - t0
        other = max(0.0, (busy_seconds() - busy) - (own_seconds() - own)) / (elapsed * CORES)
        if best is None or other < best[1]:
            best = (value, other)
        if other <= budget:
            break
        log(f"  disturbed: other processes took {other:.0%} of the CPU, measuring again")
    assert best is not None
    return best


@dataclass
class Figures:
    load_s: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    batched_rows_s: list[float] = field(default_factory=list)
    pair_rows_s: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)  # CPU share others took, worst
    memory_mib: float = 0.0


def measure(
    engine: str,
    path: Path,
    row: tuple[int, ...],
    batch: int,
    args: argparse.Namespace,
    f: Figures,
) -> None:
    seconds = args.seconds
    rng = np.random.default_rng(0)
    one = rng.standard_normal((1, *row)).astype(np.float32)
    many = rng.standard_normal((batch, *row)).astype(np.float32)
    started = time.perf_counter()
    b = create(engine, path)
    b.infer({"input": one}, ["output"])
    f.load_s.append(time.perf_counter() - started)
    run_for(0.3, lambda: b.infer({"input": one}, ["output"]))  # warm
    lat, o1 = quietly(
        lambda: sorted(run_for(seconds, lambda: b.infer({"input": one}, ["output"]))),
        args.retries,
        args.quiet_budget,
    )
    f.p50_ms.append(1e3 * lat[len(lat) // 2])
    f.p99_ms.append(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))])
    b.infer({"input": many}, ["output"])
    calls, o2 = quietly(
        lambda: run_for(seconds, lambda: b.infer({"input": many}, ["output"])),
        args.retries,
        args.quiet_budget,
    )
    f.batched_rows_s.append(batch * len(calls) / sum(calls))
    b.close()

    pair = [create(engine, path, i, 2) for i in range(2)]
    for p in pair:
        p.infer({"input": one}, ["output"])

    def both() -> float:
        counts = [0, 0]
        barrier = threading.Barrier(2)

        def drive(i: int) -> None:
            barrier.wait()
            counts[i] = len(run_for(seconds, lambda: pair[i].infer({"input": one}, ["output"])))

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)

    rate, o3 = quietly(both, args.retries, args.quiet_budget)
    f.pair_rows_s.append(rate)
    f.other.append(max(o1, o2, o3))
    for p in pair:
        p.close()
    trim()


def memory_child(engine: str, model: str) -> None:
    """Subprocess: RSS growth of one warmed-up instance, engine libraries excluded."""
    build, row, _ = MODELS[model]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = modelgen.write_model(Path(tmp), "tiny", modelgen.identity("FP32", [4])) / "1"
        t = create(engine, tiny / "model.onnx")
        t.infer({"INPUT0": np.ones((1, 4), np.float32)}, ["OUTPUT0"])
        t.close()
        path = modelgen.write_model(Path(tmp), model, build()) / "1" / "model.onnx"
        trim()
        before = rss()
        b = create(engine, path)
        b.infer({"input": np.ones((1, *row), np.float32)}, ["output"])
        trim()
        print(json.dumps({"bytes": rss() - before}))
        b.close()


def memory_of(engine: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", engine, model],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["bytes"]) / 2**20


def cell(values: list[float], fmt: str) -> str:
    mid = statistics.median(values)
    if len(values) < 2:
        return format(mid, fmt)
    return f"{format(mid, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="repeats, engines alternating")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--quiet-budget",
        type=float,
        default=0.10,
        help="share of the CPU other processes may take during a measurement (0.10)",
    )
    parser.add_argument("--retries", type=int, default=3, help="re-measurements when disturbed")
    parser.add_argument("--out", type=Path, default=None, help="report file (default: dated)")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    started = datetime.datetime.now()
    info = describe("onnxruntime", "openvino", "numpy")
    models = [m for m in args.models.split(",") if m]
    results: dict[tuple[str, str], Figures] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            build, row, batch = MODELS[model]
            path = modelgen.write_model(Path(tmp), model, build()) / "1" / "model.onnx"
            for engine in ENGINES:
                results[(model, engine)] = Figures()
                log(f"{model} / {engine}: memory (subprocess)")
                results[(model, engine)].memory_mib = memory_of(engine, model)
            for r in range(args.rounds):
                for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    log(f"{model} / {engine}: round {r + 1} of {args.rounds}")
                    measure(engine, path, row, batch, args, results[(model, engine)])
    info["load average after run (1/5/15 min)"] = " ".join(f"{x:.2f}" for x in os.getloadavg())

    lines = [
        f"# ONNX Runtime vs OpenVINO, started {started:%Y-%m-%d %H:%M:%S}",
        "",
        "```",
        "python3 " + " ".join(["benchmarks/bench_backends.py", *sys.argv[1:]]),
        "```",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in info.items()],
        "",
        f"## Figures (median of {args.rounds} rounds, range in brackets; "
        f"{args.seconds:g} s per measurement)",
        "",
        "| model | engine | load s | memory MiB | batch 1 p50 ms | p99 ms | batched rows/s "
        "| 2 instances rows/s | other CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for model in models:
        batch = MODELS[model][2]
        for engine in ENGINES:
            f = results[(model, engine)]
            lines.append(
                f"| {model} | {engine} | {cell(f.load_s, '.2f')} | {f.memory_mib:.1f} "
                f"| {cell(f.p50_ms, '.3f')} | {cell(f.p99_ms, '.3f')} "
                f"| {cell(f.batched_rows_s, ',.0f')} (batch {batch}) "
                f"| {cell(f.pair_rows_s, ',.0f')} | {max(f.other):.0%} |"
            )
        o, v = results[(model, "onnxruntime")], results[(model, "openvino")]
        ratios += [
            statistics.median(o.p50_ms) / statistics.median(v.p50_ms),
            statistics.median(v.batched_rows_s) / statistics.median(o.batched_rows_s),
            statistics.median(v.pair_rows_s) / statistics.median(o.pair_rows_s),
        ]
    gmean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    faster = (
        "openvino" if gmean > 1.05 else "onnxruntime" if gmean < 1 / 1.05 else "neither (within 5%)"
    )
    lines += [
        "",
        f"OpenVINO speed relative to ONNX Runtime, geometric mean of the {len(ratios)} speed "
        f"figures (batch-1 p50, batched rows/s, 2-instance rows/s): **{gmean:.2f}x**; "
        f"faster on this machine: **{faster}**.",
        "",
    ]
    report = "\n".join(lines)
    print(report)
    out = args.out or Path(__file__).parent / "results" / f"{started:%Y-%m-%d}-backends.md"
    out.write_text(report, encoding="utf-8")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
