"""GPU check: build a TensorRT engine from a test ONNX model, serve it through the
appliance, compare its outputs with ONNX Runtime on the CPU, and measure throughput.

Run by ``benchmarks/gpu_check.sh`` on a machine with an NVIDIA GPU, TensorRT 10 and
pycuda (``pip install 'appliance[tensorrt]'``; on Jetson, JetPack's TensorRT). Exits
non-zero when a model fails to load or disagrees with the CPU beyond tolerance.

``--backend openvino`` (or ``onnxruntime``) runs the same plumbing on a CPU, to check
the script itself where no GPU is available; its figures say nothing about GPUs.

    python3 benchmarks/gpu_check.py [--seconds 10] [--concurrency 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout: devtools/ is not installed

from appliance import InProcessServer  # noqa: E402
from devtools import modelgen  # noqa: E402

# (rtol, atol) against ONNX Runtime FP32 on the CPU, for the softmax output
TOLERANCE = {"FP32": (1e-3, 1e-5), "FP16": (5e-2, 1e-4)}
MAX_BATCH = 16


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def config(backend: str, precision: str) -> str:
    lines = [
        f"backend: {backend}",
        "default_model_filename: model.onnx",
        f"max_batch_size: {MAX_BATCH}",
        "dynamic_batching: {max_queue_delay_microseconds: 1000}",
    ]
    if backend == "tensorrt":
        lines += [
            "instance_group: [{count: 1, kind: KIND_GPU}]",
            f"parameters: {{precision: {precision}}}",
        ]
    return "\n".join(lines) + "\n"


def load_rate(
    server: InProcessServer, model: str, frame: np.ndarray, seconds: float, concurrency: int
) -> tuple[float, float, float]:
    """rows/s, p50 ms, p99 ms of single-row requests from ``concurrency`` threads."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            server.infer_blocking(model, {"input": frame})
            latencies[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    flat = sorted(x for part in latencies for x in part)
    return (
        len(flat) / elapsed,
        1e3 * flat[len(flat) // 2],
        1e3 * flat[min(len(flat) - 1, int(0.99 * len(flat)))],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="tensorrt", help="tensorrt (default) or a CPU dry run")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = datetime.datetime.now()
    lines = [f"# GPU check ({args.backend}), started {started:%Y-%m-%d %H:%M:%S}", ""]
    info = {"Python": platform.python_version(), "machine": platform.machine()}
    if args.backend == "tensorrt":
        import pycuda.driver as cuda
        import tensorrt as trt

        cuda.init()
        device = cuda.Device(0)
        info |= {
            "GPU": f"{device.name()} (sm {'.'.join(map(str, device.compute_capability()))})",
            "TensorRT": trt.__version__,
        }
    lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in info.items()], ""]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        data = modelgen.classifier()
        modelgen.write_model(repo, "reference", data, config("onnxruntime", "FP32"))  # CPU
        precisions = ("FP32", "FP16") if args.backend == "tensorrt" else ("FP32",)
        for p in precisions:
            modelgen.write_model(repo, f"classifier_{p.lower()}", data, config(args.backend, p))
        log("starting the appliance (the first load builds the TensorRT engines: minutes)")
        t0 = time.perf_counter()
        with InProcessServer(repo) as server:
            log(f"ready in {time.perf_counter() - t0:.1f}s")
            lines += [f"start-up incl. engine builds: {time.perf_counter() - t0:.1f} s", ""]
            for entry in server.index():
                if entry.get("state") != "READY":
                    log(f"model {entry['name']} failed to load: {entry.get('reason')}")
                    failed = True
            rng = np.random.default_rng(0)
            batch = rng.standard_normal((MAX_BATCH, 3, 224, 224)).astype(np.float32)
            want = server.infer_blocking("reference", {"input": batch})["output"]
            lines += [
                "| model | max abs diff vs ORT CPU | argmax agree | rows/s | p50 ms | p99 ms |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for name in ["reference"] + [f"classifier_{p.lower()}" for p in precisions]:
                if failed:
                    break
                got = server.infer_blocking(name, {"input": batch})["output"]
                diff = float(np.abs(got - want).max())
                agree = float((got.argmax(1) == want.argmax(1)).mean())
                precision = "FP16" if name.endswith("fp16") else "FP32"
                rtol, atol = TOLERANCE[precision]
                if not np.allclose(got, want, rtol=rtol, atol=atol):
                    log(f"{name}: outputs disagree with ONNX Runtime (max abs diff {diff:.3g})")
                    failed = True
                log(f"{name}: {args.seconds:g}s at concurrency {args.concurrency}")
                rate, p50, p99 = load_rate(server, name, batch[:1], args.seconds, args.concurrency)
                stats = server.statistics(name)["model_stats"][0]
                sizes = [b["batch_size"] for b in stats.get("batch_stats", [])]
                lines.append(
                    f"| {name} | {diff:.3g} | {agree:.0%} | {rate:,.0f} | {p50:.2f} | {p99:.2f} |"
                )
                log(f"{name}: {rate:,.0f} rows/s, batch sizes used {sorted(sizes)[-3:]}")
    lines += ["", f"result: **{'FAILED' if failed else 'passed'}**", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
        log(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
