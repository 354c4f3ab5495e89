"""Triton's own load generator, perf_analyzer, against the appliance: HTTP, gRPC and
system shared memory side by side.

A benchmark, not a test. It starts the appliance (``python -m appliance serve`` on
free loopback ports, the demo repository, ``shared_memory: system``), then runs
perf_analyzer once per case and prints one table: for each client concurrency the
throughput (infer/s) and average latency (us) of every case. Cases: ``simple`` over
HTTP and gRPC, each sync and async, and with ``--shared-memory system``; gRPC
streaming; the ``classifier`` with ``--input-data random`` over HTTP and gRPC.

perf_analyzer: ``--perf-analyzer PATH`` (default: ``$PERF_ANALYZER``, else
``perf_analyzer`` on PATH). On a Debian 12 machine the pip wheel lacks a runnable
binary (it needs glibc 2.38); a wrapper that runs the real binary through a newer
loader works unchanged (the project's team keeps one; see docs/triton-compatibility.md).

Stability: perf_analyzer repeats a measurement window until three in a row agree
within ``--stability-percentage``; a case that never settles prints "unstable". On
a shared machine raise it (``--stability 100``) and read the figures as indicative.

    python benchmarks/bench_perf_analyzer.py --perf-analyzer PATH [--interval-ms 3000]

Results are printed as markdown and written to ``benchmarks/results/<date>-perf-analyzer.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from machine import describe

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec")

# (label, model, protocol, extra perf_analyzer flags)
CASES: list[tuple[str, str, str, list[str]]] = [
    ("HTTP sync", "simple", "http", ["--sync"]),
    ("gRPC sync", "simple", "grpc", ["--sync"]),
    ("HTTP shm", "simple", "http", ["--sync", "--shared-memory", "system"]),
    ("gRPC shm", "simple", "grpc", ["--sync", "--shared-memory", "system"]),
    ("HTTP async", "simple", "http", ["--async"]),
    ("gRPC async", "simple", "grpc", ["--async"]),
    ("gRPC stream", "simple", "grpc", ["--async", "--streaming"]),
    ("classifier HTTP", "classifier", "http", ["--sync", "--input-data", "random"]),
    ("classifier gRPC", "classifier", "grpc", ["--sync", "--input-data", "random"]),
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    config = workdir / "appliance.yaml"
    config.write_text(
        f"http_port: {http}\ngrpc_port: {grpc}\nmetrics_port: {metrics}\n"
        "shared_memory: system\nlog_level: warning\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(workdir / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2):
                return proc, http, grpc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server not ready after 120 s")


def levels(spec: str) -> list[int]:
    """perf_analyzer's ``start:end:step`` -> the concurrencies it would run."""
    parts = [int(x) for x in spec.split(":")]
    start, end, step = [*parts, parts[0], 1][:3] if len(parts) < 3 else parts
    return list(range(start, end + 1, step))


def run_case(
    pa: str, model: str, url: str, protocol: str, flags: list[str], args: argparse.Namespace
) -> tuple[dict[int, tuple[float, int]], str]:
    """perf_analyzer once per concurrency level (so an unstable level does not end the
    case): {concurrency: (infer/s, latency us)} and the output of every run."""
    rows: dict[int, tuple[float, int]] = {}
    outputs = []
    for level in levels(args.concurrency):
        got, out = _run_level(pa, model, url, protocol, flags, args, level)
        rows.update(got)
        outputs.append(out)
    return rows, "\n".join(outputs)


def _run_level(
    pa: str,
    model: str,
    url: str,
    protocol: str,
    flags: list[str],
    args: argparse.Namespace,
    level: int,
) -> tuple[dict[int, tuple[float, int]], str]:
    cmd = [
        pa,
        "-m",
        model,
        "-u",
        url,
        "-i",
        protocol,
        "--concurrency-range",
        str(level),
        "--measurement-interval",
        str(args.interval_ms),
        "--stability-percentage",
        str(args.stability),
        "--max-trials",
        str(args.max_trials),
        *flags,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout_s)
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = f"timed out after {args.case_timeout_s}s\n{exc.stdout or ''}"
    rows = {int(c): (float(t), int(lat)) for c, t, lat in ROW.findall(out)}
    return rows, out


def table(results: dict[str, dict[int, tuple[float, int]]]) -> str:
    levels = sorted({c for rows in results.values() for c in rows})
    head = "| concurrency | " + " | ".join(results) + " |"
    sep = "|---|" + "---|" * len(results)
    lines = [head, sep]
    for c in levels:
        cells = []
        for rows in results.values():
            cells.append(f"{rows[c][0]:.0f}/s, {rows[c][1]} us" if c in rows else "unstable")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf-analyzer", default=os.environ.get("PERF_ANALYZER", ""))
    parser.add_argument("--concurrency", default="1:16:4")
    parser.add_argument("--interval-ms", type=int, default=3000)
    parser.add_argument("--stability", type=int, default=25, help="percent")
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--case-timeout-s", type=int, default=600)
    parser.add_argument("--cases", default="", help="comma-separated labels (default: all)")
    parser.add_argument("--note", default="", help="a line for the report")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    pa = args.perf_analyzer or shutil.which("perf_analyzer") or ""
    if not pa:
        sys.exit("perf_analyzer not found: pass --perf-analyzer PATH")
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    machine = describe("onnxruntime", "grpcio", "aiohttp")
    try:
        version = subprocess.run([pa, "--version"], capture_output=True, text=True, timeout=60)
        machine["perf_analyzer"] = (version.stdout or version.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        machine["perf_analyzer"] = "unknown"
    results: dict[str, dict[int, tuple[float, int]]] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, http, grpc = start_server(Path(tmp))
        try:
            for label, model, protocol, flags in CASES:
                if wanted and label not in wanted:
                    continue
                url = f"127.0.0.1:{http if protocol == 'http' else grpc}"
                print(f"running {label} ...", file=sys.stderr, flush=True)
                rows, out = run_case(pa, model, url, protocol, flags, args)
                results[label] = rows
                errors = [ln for ln in out.splitlines() if "rror" in ln or "ailed" in ln]
                if errors:
                    failures[label] = "; ".join(dict.fromkeys(errors))[:400]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    command = "python benchmarks/bench_perf_analyzer.py " + " ".join(sys.argv[1:])
    report = [
        f"# perf_analyzer against the appliance ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        f"perf_analyzer flags: `--concurrency-range {args.concurrency} --measurement-interval "
        f"{args.interval_ms} --stability-percentage {args.stability} --max-trials "
        f"{args.max_trials}`; model `simple` (INT32 [1,16] x2) unless named; cells: "
        "throughput, average client latency.",
        "",
        "| machine | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine.items()],
        "",
        table(results),
    ]
    if args.note:
        report += ["", args.note]
    if failures:
        report += ["", "perf_analyzer's messages:", ""]
        report += [f"- {label}: {text}" for label, text in failures.items()]
    text = "\n".join(report) + "\n"
    print(text)
    if not args.no_write:
        out = ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-perf-analyzer.md"
        out.write_text(text)
        print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
