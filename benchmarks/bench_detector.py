"""A real detector at low load: served vs ONNX Runtime in-process, and how instances
share the cores.

A benchmark, not a test. The model is the YOLOv8n the nudenet wheel ships (fetched
with pip and cached by ``tests/real_models.py``). Each round measures, in turn:

- ``in-process``: one ONNX Runtime session with every usable core as intra-op threads,
  ``--runs`` calls at concurrency 1;
- one server per arrangement, served over HTTP binary (tritonclient):
  ``no config`` (what auto-complete gives: one instance), ``2 inst, shared pool`` (two
  instances on one session whose pool has every core: the rule since 2026-12-01) and
  ``2 inst, cores/2 each`` (``intra_op_thread_count`` = half the cores: the rule before);
  p10/p50/p90 at concurrency 1 (p10: the quiet moments on a shared machine), then
  throughput at ``--concurrency`` (default 2,4) closed-loop clients for ``--seconds``.

Rounds alternate (``--rounds``) so noise falls on every arrangement alike; the load
average is printed with each row. Servers are stopped by PID.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # run from a checkout without installing
sys.path.insert(0, str(HERE / "tests"))  # the wheel fetcher the tests use

# appliance first: it switches ONNX Runtime's telemetry off before the engine is
# imported (docs/security.md), here too, for the in-process baseline
import appliance  # noqa: E402, F401, I001
import onnxruntime as ort  # noqa: E402

from machine import describe  # noqa: E402
from probes import free_port  # noqa: E402
from real_models import NUDENET, YOLOV8N, wheel  # noqa: E402

from appliance.core.instances import cpu_share  # noqa: E402

ARRANGEMENTS = {
    "no config": None,
    "2 inst, shared pool": "instance_group: [{count: 2, kind: KIND_CPU}]\n",
    "2 inst, cores/2 each": (
        "instance_group: [{count: 2, kind: KIND_CPU}]\n"
        f"parameters: {{intra_op_thread_count: '{max(1, cpu_share(2))}'}}\n"
    ),
}


def image(size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.random((1, 3, size, size), dtype=np.float32)


def in_process(model: Path, x: np.ndarray, runs: int) -> list[float]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = cpu_share(1)
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    for _ in range(3):
        s.run(None, {"images": x})
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run(None, {"images": x})
        times.append(time.perf_counter() - t)
    return times


def serve(repo: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "appliance", "serve", "--model-repository", str(repo),
           "--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1",
           "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    return subprocess.Popen(
        cmd, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb")
    )


def request(
    x: np.ndarray,
) -> tuple[list[httpclient.InferInput], list[httpclient.InferRequestedOutput]]:
    inp = httpclient.InferInput("images", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return [inp], [httpclient.InferRequestedOutput("output0", binary_data=True)]


def lone(url: str, x: np.ndarray, runs: int) -> list[float]:
    client = httpclient.InferenceServerClient(url)
    inputs, outputs = request(x)
    for _ in range(3):
        client.infer("yolo", inputs, outputs=outputs)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        client.infer("yolo", inputs, outputs=outputs)
        times.append(time.perf_counter() - t)
    client.close()
    return times


def throughput(url: str, x: np.ndarray, clients: int, seconds: float) -> float:
    done = [0] * clients
    end = time.perf_counter() + seconds

    def caller(i: int) -> None:
        client = httpclient.InferenceServerClient(url)
        inputs, outputs = request(x)
        while time.perf_counter() < end:
            client.infer("yolo", inputs, outputs=outputs)
            done[i] += 1
        client.close()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def ms(times: list[float], q: float) -> float:
    return float(np.percentile(times, q) * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=320, help="image side (multiple of 32)")
    ap.add_argument("--runs", type=int, default=40, help="requests at concurrency 1")
    ap.add_argument("--concurrency", default="2,4")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = wheel(NUDENET, (YOLOV8N,)) / YOLOV8N
    x = image(a.size)
    levels = [int(c) for c in a.concurrency.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="bench-det-"))
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, config in ARRANGEMENTS.items():
            repo = work / name.replace(" ", "_").replace(",", "").replace("/", "-")
            (repo / "yolo" / "1").mkdir(parents=True)
            (repo / "yolo" / "1" / "model.onnx").write_bytes(model.read_bytes())
            if config:
                (repo / "yolo" / "config.yaml").write_text("backend: onnxruntime\n" + config)
            port = free_port()
            servers[name] = (serve(repo, port, work / f"{port}.log"), f"127.0.0.1:{port}")
        for _, url in servers.values():
            client = httpclient.InferenceServerClient(url)
            end = time.monotonic() + 120
            while time.monotonic() < end:
                try:
                    if client.is_model_ready("yolo"):
                        break
                except Exception:  # not listening yet
                    pass
                time.sleep(0.3)
            client.close()
        print("| | |\n|---|---|")
        for k, v in describe("onnxruntime").items():
            print(f"| {k} | {v} |")
        print(
            f"\nYOLOv8n ({NUDENET}, {YOLOV8N}), "
            f"1x3x{a.size}x{a.size} FP32, HTTP binary; in-process: {cpu_share(1)} "
            "intra-op threads.\n"
        )
        head = "| round | arrangement | c=1 p10 ms | c=1 p50 ms | c=1 p90 ms | vs in-process p50 |"
        head += "".join(f" c={c} infer/s |" for c in levels) + " load (1 min) |"
        print(head)
        print("|---|---|---:|---:|---:|---:|" + "---:|" * len(levels) + "---:|")
        for r in range(a.rounds):
            base = in_process(model, x, a.runs)
            print(
                f"| {r + 1} | in-process | {ms(base, 10):.2f} | {ms(base, 50):.2f} | "
                f"{ms(base, 90):.2f} | 1.00 |"
                + " - |" * len(levels) + f" {os.getloadavg()[0]:.2f} |", flush=True,
            )  # fmt: skip
            for name, (_, url) in servers.items():
                t = lone(url, x, a.runs)
                rates = [throughput(url, x, c, a.seconds) for c in levels]
                print(
                    f"| {r + 1} | {name} | {ms(t, 10):.2f} | {ms(t, 50):.2f} | {ms(t, 90):.2f} | "
                    f"{ms(t, 50) / ms(base, 50):.2f} |"
                    + "".join(f" {v:.1f} |" for v in rates)
                    + f" {os.getloadavg()[0]:.2f} |",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
