"""How fast hostile requests are refused, and what the rest of the server sees meanwhile.

    python3 benchmarks/bench_refusal.py [--out FILE]

Starts ``python -m appliance serve`` (the demo models) as a subprocess on free
loopback ports and sends, one at a time, while a second client asks
``/v2/health/live`` every 10 ms:

1. the BYTES flood the wire-safety hardening closed: ``image_classifier`` IMAGE declared
   ``[15000000, 1]`` with a 60 MB body of zero-length strings;
2. ``Content-Length: 2147483648`` followed by 2 bytes;
3. a JSON request with ``shape [0, 4611686018427387904]``.

For each: the time to the answer and its status, the slowest health answer during
it, and the server's peak RSS (``VmHWM``) after it. Run it with ``PYTHONPATH`` set to
another checkout to compare. Takes about ten seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from machine import describe  # benchmarks/machine.py, next to this script

COUNT = 15_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _raw(port: int, data: bytes) -> str:
    """Send ``data``; the status line of the answer (or what went wrong)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(data)
            answer = sock.recv(256)
        except OSError as exc:
            return f"connection error: {exc}"
    return answer.split(b"\r\n", 1)[0].decode("latin-1") or "closed without an answer"


def _flood() -> bytes:
    header = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [COUNT, 1],
                                     "parameters": {"binary_data_size": 4 * COUNT}}]}).encode()
    body = header + b"\0\0\0\0" * COUNT
    return (
        b"POST /v2/models/image_classifier/infer HTTP/1.1\r\nHost: b\r\n"
        + f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n"
        .encode() + b"\r\n" + body
    )


def _huge_length() -> bytes:
    return (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: b\r\n"
            b"Content-Length: 2147483648\r\n\r\n{}")


def _impossible_shape() -> bytes:
    doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [0, 4611686018427387904],
                       "data": []} for n in ("INPUT0", "INPUT1")]}
    body = json.dumps(doc).encode()
    return (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: b\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def _measure(port: int, pid: int, data: bytes) -> tuple[str, float, float, float]:
    slowest = 0.0
    done = threading.Event()

    def probe() -> None:
        nonlocal slowest
        while not done.is_set():
            t = time.perf_counter()
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=60).read()
            slowest = max(slowest, time.perf_counter() - t)
            time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    started = time.perf_counter()
    status = _raw(port, data)
    took = time.perf_counter() - started
    done.set()
    thread.join()
    return status, took, slowest, _peak_rss_mib(pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--http-port", str(port),
         "--grpc-port", "-1", "--metrics-port", "-1", "--log-level", "warning"],
        env=os.environ.copy(),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not become ready"
                time.sleep(0.2)
        out = ["# Refusing hostile requests", "", f"{datetime.date.today()}", "",
               "| machine | |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in describe("aiohttp", "numpy").items()]
        out += ["", f"Server peak RSS after start-up: {_peak_rss_mib(server.pid):.0f} MiB", "",
                "| request | answer | time to answer | slowest /v2/health/live meanwhile "
                "| server peak RSS after |", "|---|---|---:|---:|---:|"]
        for label, data in (
            ("BYTES [15000000, 1], 60 MB, to image_classifier", _flood()),
            ("Content-Length: 2147483648, 2 bytes sent", _huge_length()),
            ("JSON shape [0, 2**62]", _impossible_shape()),
        ):
            status, took, slowest, rss = _measure(port, server.pid, data)
            out.append(f"| {label} | {status} | {took * 1000:.0f} ms | {slowest * 1000:.0f} ms "
                       f"| {rss:.0f} MiB |")
    finally:
        server.terminate()
        server.wait(60)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
