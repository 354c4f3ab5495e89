"""Overload: many connections posting classifier frames; does memory stay bounded and return?

A benchmark, not a test. It starts the server as a subprocess (``python -m
appliance serve`` on the built-in demo models, HTTP only, on a free loopback
port), then ``--connections`` aiohttp connections each post one ``classifier``
frame (FP32 [1,3,224,224] with the binary tensor extension: 588 KiB) after
another for ``--seconds``. It records the server's resident memory (VmRSS from
/proc) before the load, its peak during the load and after ``--idle`` seconds of
quiet, the status counts (200 / 503 / other / connection errors) and the latency
percentiles of the answered (200) requests. Every loop is bounded by time and by
``--max-requests``; the server is stopped with SIGTERM by PID at the end.

Extra server settings go in with ``--set key=value`` (written to the server's
appliance.yaml), e.g. ``--set max_queued_bytes=64MiB``; ``--env NAME=VALUE`` sets
an environment variable for the server (e.g. ``MALLOC_ARENA_MAX=2``).

    python benchmarks/bench_overload.py --connections 200 --seconds 15 --label after

Results are printed as markdown and appended to
``benchmarks/results/<date>-overload.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)
from probes import free_port  # noqa: E402

HEADER = "Inference-Header-Content-Length"


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def frame_request() -> tuple[bytes, int]:
    frame = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 3, 224, 224],
                    "parameters": {"binary_data_size": frame.nbytes},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    return header + frame.tobytes(), len(header)


async def load(url: str, args: argparse.Namespace) -> tuple[dict[str, int], list[float]]:
    body, header_length = frame_request()
    headers = {HEADER: str(header_length), "Content-Type": "application/octet-stream"}
    counts: dict[str, int] = {"200": 0, "503": 0, "other": 0, "conn_error": 0}
    latencies: list[float] = []
    end = time.monotonic() + args.seconds
    budget = [args.max_requests]

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end and budget[0] > 0:
            budget[0] -= 1
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                counts["conn_error"] += 1
                await asyncio.sleep(0.05)
                continue
            key = str(status) if status in (200, 503) else "other"
            counts[key] += 1
            if status == 200:
                latencies.append(time.perf_counter() - t0)

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=args.connections)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.connections)))
    return counts, latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--idle", type=float, default=5.0, help="quiet seconds before 'after' RSS")
    p.add_argument("--max-requests", type=int, default=200_000)
    p.add_argument("--set", action="append", default=[], help="server setting key=value")
    p.add_argument("--env", action="append", default=[], help="server env NAME=VALUE")
    p.add_argument("--label", default="", help="a name for this run in the report")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "appliance.yaml"
        lines = ["grpc_port: -1", "metrics_port: -1", f"http_port: {port}"]
        lines += [": ".join(kv.split("=", 1)) for kv in args.set]
        config.write_text("\n".join(lines) + "\n")
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.update(kv.split("=", 1) for kv in args.env)
        command = [sys.executable, "-m", "appliance", "serve", "--config", str(config)]
        server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not become ready")
                time.sleep(0.2)
            before = rss_mib(server.pid)
            peak = [before]
            stop = asyncio.Event()

            async def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_mib(server.pid))
                    await asyncio.sleep(0.1)

            async def run() -> tuple[dict[str, int], list[float]]:
                sampler = asyncio.ensure_future(sample())
                try:
                    return await load(f"{url}/v2/models/classifier/infer", args)
                finally:
                    stop.set()
                    await sampler

            started = time.monotonic()
            counts, latencies = asyncio.run(run())
            took = time.monotonic() - started
            time.sleep(args.idle)
            after = rss_mib(server.pid)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    row = (
        f"| {args.label or '-'} | {args.connections} | {took:.1f} | {before:.0f} | "
        f"{max(peak[0], after):.0f} | {after:.0f} | {counts['200']} | {counts['503']} | "
        f"{counts['other']} | {counts['conn_error']} | {np.percentile(lat, 50):.0f} | "
        f"{np.percentile(lat, 99):.0f} |"
    )
    header = (
        "| run | connections | seconds | RSS before MiB | RSS peak MiB | RSS after idle MiB "
        "| 200 | 503 | other | conn errors | p50 ms (200s) | p99 ms (200s) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header)
    print(row)
    if args.no_write:
        return
    out = REPO_ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-overload.md"
    text = "" if not out.exists() else out.read_text()
    if not text:
        machine = "\n".join(f"| {k} | {v} |" for k, v in describe("aiohttp", "numpy").items())
        text = f"# Overload: memory before/peak/after\n\n| | |\n|---|---|\n{machine}\n\n"
    cmd = shlex.join(["python", "benchmarks/bench_overload.py", *sys.argv[1:]])
    text += f"`{cmd}`\n\n{header}\n{row}\n\n"
    out.write_text(text)


if __name__ == "__main__":
    main()
