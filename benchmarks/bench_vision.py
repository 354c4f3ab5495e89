"""The DeepStack detection API and camera streams, with a real 640x640 detector.

A benchmark, not a test. The detector is the YOLOv8n the nudenet wheel ships (fetched
and cached by ``tests/real_models.py``), served at 640x640 (its dims are dynamic) with
``max_batch_size: 4`` and dynamic batching. One ``appliance serve`` per part, on
127.0.0.1, stopped by its PID.

1. **Detection API**, the way Frigate's ``deepstack`` plugin calls it: one
   ``requests`` session, one multipart POST (JPEG ``image`` + ``api_key``) at a time,
   ``--frames`` frames per image size; p50/p90/p99 per frame. Beside it the same
   model in-process (ONNX Runtime on a 640x640 tensor, no decode, no HTTP).
2. **Camera streams**: 1 and 4 streams, each an H.264 1280x720 file (written with
   PyAV) looped at ``--fps``, for ``--seconds``: per stream the frames decoded,
   inferred and dropped, the inferred rate, the drop rate, decode time and
   end-to-end latency (decoded to published) from ``GET /v1/streams``, and how many
   frames the model ran per execution (its statistics).
3. **Decoders**: 300 frames of H.264 1280x720 decoded to RGB by PyAV in-process and by
   GStreamer's software path (``openh264dec``, ``videoconvert``) in Debian's python3:
   wall and CPU milliseconds per frame (``--parts`` picks which of the three run).

    python benchmarks/bench_vision.py [--frames 200] [--fps 10] [--seconds 20]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import appliance  # noqa: E402, F401, I001  (ONNX Runtime's telemetry off first)
import onnxruntime as ort  # noqa: E402
from cameras import h264_file, picture  # noqa: E402
from machine import describe  # noqa: E402
from probes import free_port  # noqa: E402
from real_models import NUDENET, YOLOV8N, wheel  # noqa: E402

CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
input [{name: "images", data_type: TYPE_FP32, dims: [3, 640, 640]}]
output [{name: "output0", data_type: TYPE_FP32, dims: [22, 8400]}]
dynamic_batching {max_queue_delay_microseconds: DELAY}
"""
TOKEN = "bench"


def serve(repo: Path, config: dict[str, Any], workdir: Path) -> tuple[subprocess.Popen[str], int]:
    path = workdir / f"appliance-{time.monotonic_ns()}.yaml"
    port = free_port()
    path.write_text(json.dumps({**config, "model_repository": str(repo)}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance",
            "serve",
            "--config",
            str(path),
            "--http-port",
            str(port),
            "--grpc-port",
            "-1",
            "--metrics-port",
            "-1",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
    )
    for _ in range(600):  # ready within 60 s
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become ready")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    picture(3, width, height).save(out, format="JPEG", quality=85)
    return out.getvalue()


def api(repo: Path, model: Path, frames: int, workdir: Path) -> list[str]:
    rows = [
        "| call | frames | p50 ms | p90 ms | p99 ms | predictions |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    so = ort.SessionOptions()  # as the server's engine runs it: every core, no spinning
    so.intra_op_num_threads = os.cpu_count() or 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    times = []
    for _ in range(frames):
        started = time.perf_counter()
        session.run(None, {"images": x})
        times.append(time.perf_counter() - started)
    rows.append(
        f"| ONNX Runtime in-process (no spinning), 640x640 tensor | {frames} | "
        f"{pct(times, 50):.1f} | {pct(times, 90):.1f} | {pct(times, 99):.1f} | - |"
    )
    del session
    vision = {"detectors": {"yolo": {"min_confidence": 0.01}}}
    proc, port = serve(repo, {"vision": vision, "inference_token": TOKEN}, workdir)
    try:
        url = f"http://127.0.0.1:{port}/v1/vision/detection"
        with requests.Session() as client:
            for width, height in ((640, 640), (1280, 720), (1920, 1080)):
                body = jpeg(width, height)
                client.post(url, data={"api_key": TOKEN}, files={"image": body}, timeout=30)
                times, found = [], 0
                for _ in range(frames):
                    started = time.perf_counter()
                    answer = client.post(
                        url, data={"api_key": TOKEN}, files={"image": body}, timeout=30
                    )
                    times.append(time.perf_counter() - started)
                    doc = answer.json()
                    assert doc["success"], doc
                    found = len(doc["predictions"])
                what = f"{width}x{height} JPEG ({len(body) // 1024} KiB)"
                rows.append(
                    f"| POST /v1/vision/detection, {what} | {frames} | {pct(times, 50):.1f} | "
                    f"{pct(times, 90):.1f} | {pct(times, 99):.1f} | {found} |"
                )
    finally:
        stop(proc)
    return rows


def streams(
    repo: Path, count: int, fps: int, seconds: float, clip: Path, workdir: Path
) -> list[str]:
    vision = {"detectors": {"yolo": {"min_confidence": 0.25}}}
    config = {
        "vision": vision,
        "streams": [
            {
                "name": f"cam{i}",
                "url": str(clip),
                "fps": fps,
                "jsonl": str(workdir / f"cam{i}.jsonl"),
            }
            for i in range(count)
        ],
    }
    proc, port = serve(repo, config, workdir)
    try:
        time.sleep(3)  # warm: the first frames load caches

        def read() -> tuple[dict[str, Any], dict[str, Any]]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/streams", timeout=10) as a:
                s = {x["name"]: x for x in json.loads(a.read())["streams"]}
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v2/models/yolo/stats", timeout=10
            ) as a:
                m = json.loads(a.read())["model_stats"][0]
            return s, m

        before, m0 = read()
        time.sleep(seconds)
        after, m1 = read()
    finally:
        stop(proc)
    rows = []
    executions = m1["execution_count"] - m0["execution_count"]
    inferences = m1["inference_count"] - m0["inference_count"]
    for name in sorted(after):
        a, b = after[name], before[name]
        decoded = a["frames_decoded"] - b["frames_decoded"]
        inferred = a["frames_inferred"] - b["frames_inferred"]
        dropped = a["frames_dropped"] - b["frames_dropped"]
        rows.append(
            f"| {count} | {name} | {decoded / seconds:.1f} | {inferred / seconds:.1f} | "
            f"{dropped / max(decoded, 1):.0%} | {a['decode_ms_mean']} | {a['e2e_ms_p50']} | "
            f"{a['e2e_ms_p99']} | {inferences / max(executions, 1):.2f} |"
        )
    return rows


GST_DECODE = (
    "filesrc location={path} ! qtdemux ! h264parse ! openh264dec ! videoconvert"
    " ! video/x-raw,format=RGB ! appsink name=frames sync=false"
)


def decoders(clip: Path, frames: int) -> list[str]:
    """Decoding ``clip`` (H.264 1280x720) to RGB frames, one decoder at a time: PyAV
    in-process (FFmpeg's h264), GStreamer's software path (openh264dec, videoconvert) in
    Debian's python3 (tests/gst_pull.py); wall and CPU seconds per frame."""
    import resource

    import av

    rows = ["| decoder | frames | wall ms/frame | CPU ms/frame |", "|---|---:|---:|---:|"]
    wall, cpu = time.perf_counter(), time.process_time()
    with av.open(str(clip)) as container:
        count = 0
        for frame in container.decode(video=0):
            frame.to_ndarray(format="rgb24")
            count += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows.append(
        f"| PyAV {av.__version__} (FFmpeg h264, rgb24) | {count} | "
        f"{wall / count * 1000:.2f} | {cpu / count * 1000:.2f} |"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [
            "/usr/bin/python3",
            str(ROOT / "tests" / "gst_pull.py"),
            GST_DECODE.format(path=clip),
            str(frames),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        rows.append(f"| GStreamer openh264dec | - | not run: {done.stdout[-80:]!r} | - |")
        return rows
    count = len(done.stdout.splitlines())
    rows.append(
        f"| GStreamer openh264dec + videoconvert (RGB), incl. process start | {count} | "
        f"{wall / count * 1000:.2f} | {cpu / count * 1000:.2f} |"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--parts", default="api,streams,decoders")
    parser.add_argument("--queue-delay-us", type=int, default=2000)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model = wheel(NUDENET, (YOLOV8N,)) / YOLOV8N
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"
        (repo / "yolo" / "1").mkdir(parents=True)
        (repo / "yolo" / "1" / "model.onnx").write_bytes(model.read_bytes())
        (repo / "yolo" / "config.pbtxt").write_text(
            CONFIG.replace("DELAY", str(args.queue_delay_us))
        )
        print(f"# Vision API and camera streams, {dt.date.today()}\n")
        print(
            f"Command: `python3 benchmarks/bench_vision.py --frames {args.frames} --fps {args.fps} "
            f"--seconds {args.seconds:g}`\n"
        )
        print("| | |\n|---|---|")
        for key, value in describe("onnxruntime", "av", "pillow").items():
            print(f"| {key} | {value} |")
        print()
        if "api" in parts:
            print("## Detection API (Frigate's way: one JPEG at a time, requests multipart)\n")
            print("\n".join(api(repo, model, args.frames, work)) + "\n")
        if "decoders" in parts:
            long_clip = h264_file(work / "long.mp4", frames=300, fps=30, size=(1280, 720))
            print("## Decoders (300 frames of H.264 1280x720 to RGB, one at a time)\n")
            print("\n".join(decoders(long_clip, 300)) + "\n")
        if "streams" in parts:
            clip = h264_file(work / "clip.mp4", frames=50, fps=args.fps, size=(1280, 720))
            each = f"{args.fps} fps each, {args.seconds:g} s, queue delay {args.queue_delay_us} us"
            print(f"## Camera streams (H.264 1280x720 files looped at {each})\n")
            print(
                "| streams | stream | decoded/s | inferred/s | dropped | decode ms | e2e p50 ms | "
                "e2e p99 ms | frames per execution |"
            )
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
            for count in (1, 4):
                print("\n".join(streams(repo, count, args.fps, args.seconds, clip, work)))
        print(f"\nload average after run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
