"""Camera-frame benchmark: one 1080p RGB frame per request over HTTP, gRPC and shared memory.

A camera integrator picks a transport by what a frame costs. This sends a
1x1080x1920x3 UINT8 frame (6.2 MB) through `devtools.modelgen.frame_mean` (a cast
and a mean: cheap next to moving the frame) with the unmodified tritonclient:

  http       binary tensor extension (tritonclient.http)
  grpc       raw_input_contents (tritonclient.grpc)
  http+shm   the frame is written into a registered POSIX shm region, the request
  grpc+shm   carries only its name (Triton's system shared-memory extension)

For each: p50/p99 latency per frame (the shm copy included: a camera writes each
frame into the region) and frames/s, at concurrency 1 and 4 (one client per thread),
plus the server's CPU per frame. The server runs as a subprocess on 127.0.0.1 and is
stopped by its PID. Every loop is bounded by a frame count and a time limit.

    python benchmarks/bench_camera.py [--seconds 6] [--frames 400] [--concurrency 1,4]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)
from probes import cpu_seconds, free_port  # noqa: E402

from devtools import modelgen  # noqa: E402

SHAPE = [1, 1080, 1920, 3]
CONFIG = "max_batch_size: 4\ndynamic_batching: {max_queue_delay_microseconds: 0}\n"
PROTOCOLS = ("http", "grpc", "http+shm", "grpc+shm")


class Client:
    """One thread's connection: sends a frame and checks the answer."""

    def __init__(self, protocol: str, http_url: str, grpc_url: str, tag: str) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient
        import tritonclient.utils.shared_memory as shm

        self.kind, _, via = protocol.partition("+")
        self.lib: Any = httpclient if self.kind == "http" else grpcclient
        self.client = self.lib.InferenceServerClient(http_url if self.kind == "http" else grpc_url)
        self.size = int(np.prod(SHAPE))
        self.shm = shm
        self.handle = None
        if via == "shm":
            self.region = f"frame_{tag}"
            key = f"/appliance_bench_{os.getpid()}_{tag}"
            self.handle = shm.create_shared_memory_region(self.region, key, self.size)
            self.client.register_system_shared_memory(self.region, key, self.size)

    def infer(self, frame: np.ndarray) -> None:
        inp = self.lib.InferInput("frame", SHAPE, "UINT8")
        if self.handle is not None:
            self.shm.set_shared_memory_region(self.handle, [frame])  # the camera's write
            inp.set_shared_memory(self.region, self.size)
        else:
            inp.set_data_from_numpy(frame)
        mean = self.client.infer("frame_mean", [inp]).as_numpy("mean")
        if mean is None or mean.shape != (1, 3):
            raise RuntimeError(f"bad response: {mean!r}")

    def close(self) -> None:
        if self.handle is not None:
            self.client.unregister_system_shared_memory(self.region)
            self.shm.destroy_shared_memory_region(self.handle)
        self.client.close()


def run_case(
    protocol: str, concurrency: int, urls: tuple[str, str], pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    frame = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    clock: dict[str, float] = {}

    def go() -> None:  # runs once, when every worker is warm, before any is released
        clock["cpu0"], clock["t0"] = cpu_seconds(pid), time.perf_counter()
        clock["deadline"] = clock["t0"] + args.seconds

    start_gate = threading.Barrier(concurrency + 1, action=go)
    per_thread = max(1, args.frames // concurrency)

    def worker(i: int) -> None:
        client = Client(protocol, *urls, tag=f"{protocol.replace('+', '_')}_{i}")
        try:
            for _ in range(3):  # warm-up
                client.infer(frame)
            start_gate.wait()
            mine = []
            for _ in range(per_thread):
                if time.perf_counter() > clock["deadline"]:
                    break
                t0 = time.perf_counter()
                client.infer(frame)
                mine.append(time.perf_counter() - t0)
            with lock:
                latencies.extend(mine)
        except Exception as exc:  # reported in the table, the run goes on
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
            if start_gate.n_waiting:
                start_gate.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a worker failed: reported
        start_gate.wait(timeout=60)
    for t in threads:
        t.join(args.seconds + 60)
    if "t0" not in clock:
        go()  # the gate broke: report what (little) there is
    elapsed = time.perf_counter() - clock["t0"]
    cpu = cpu_seconds(pid) - clock["cpu0"]
    lat = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return {
        "protocol": protocol,
        "concurrency": concurrency,
        "frames": len(latencies),
        "fps": len(latencies) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "cpu_ms": cpu * 1000 / max(1, len(latencies)),
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per case")
    parser.add_argument("--frames", type=int, default=400, help="frame bound per case")
    parser.add_argument("--concurrency", default="1,4", help="client threads, e.g. 1,4")
    parser.add_argument("--out", type=Path, help="report file (default benchmarks/results/)")
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="bench_camera_"))
    modelgen.write_model(repo, "frame_mean", modelgen.frame_mean(), CONFIG)
    http_port, grpc_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "appliance", "serve", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "-1",
    ]  # fmt: skip
    config = repo / "appliance.yaml"
    config.write_text("shared_memory: system\nmax_request_size: 32MiB\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([*command, "--config", str(config)], env=env)
    rows = []
    try:
        for _ in range(300):  # ready within 30 s
            try:
                url = f"http://127.0.0.1:{http_port}/v2/health/ready"
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        urls = (f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for protocol in PROTOCOLS:
                row = run_case(protocol, concurrency, urls, server.pid, args)
                print(
                    f"{protocol:9s} c={concurrency}  {row['fps']:7.1f} frames/s  "
                    f"p50 {row['p50']:7.2f} ms  p99 {row['p99']:7.2f} ms  "
                    f"server {row['cpu_ms']:.2f} CPU-ms/frame  errors {len(row['errors'])}",
                    file=sys.stderr,
                )
                rows.append(row)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    today = dt.date.today().isoformat()
    lines = [
        f"# Camera-frame benchmark, {today}",
        "",
        "```",
        "python benchmarks/bench_camera.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        "Machine: "
        + "; ".join(f"{k} {v}" for k, v in describe("onnxruntime", "tritonclient").items())
        + ". Client and server share the machine.",
        f"Frame: UINT8 {SHAPE} ({int(np.prod(SHAPE)) / 1e6:.1f} MB) through `frame_mean`; "
        f"measured {args.seconds:g} s or {args.frames} frames per case.",
        "",
        "| transport | clients | frames/s | p50 ms | p99 ms | server CPU ms/frame | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['protocol']} | {r['concurrency']} | {r['fps']:.1f} | {r['p50']:.2f} | "
            f"{r['p99']:.2f} | {r['cpu_ms']:.2f} | {len(r['errors'])} |"
        )
    errors = [e for r in rows for e in r["errors"]]
    if errors:
        lines += ["", f"First error: `{errors[0]}`"]
    report = "\n".join(lines) + "\n"
    print(report)
    out = args.out or ROOT / "benchmarks" / "results" / f"{today}-camera.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
