"""Frames/s of the ``image_classifier`` ensemble vs the same three steps called by the client.

A benchmark, not a test. The server runs as a subprocess (``python -m appliance
serve``) on a free loopback port with a fresh demo repository, and is stopped with
SIGTERM at the end. Each frame is a 320x240 JPEG encoded once with Pillow. For each
client concurrency (default 1, 8, 32) N aiohttp workers loop for ``--seconds``:

- ``ensemble``: one KServe v2 HTTP request per frame (binary tensor extension) to
  ``image_classifier``; the steps run inside the server, tensors never leave it;
- ``client``: three requests per frame (``preprocess`` -> ``classifier`` ->
  ``postprocess``), FP32 [3,224,224] pixels and [1000] probabilities crossing HTTP.

Run: ``python benchmarks/bench_ensemble.py [--seconds 10] [--concurrency 1 8 32]``.
Results are printed as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from PIL import Image
from probes import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from devtools import modelgen  # noqa: E402

HEADER = "Inference-Header-Content-Length"


def body(
    name: str, datatype: str, shape: list[int], raw: bytes, output: str, binary: bool
) -> tuple[bytes, int]:
    """A binary-extension request body and its header length."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": output, "parameters": {"binary_data": binary}}],
        }
    )
    return header + raw, len(header)


async def post(session: aiohttp.ClientSession, url: str, payload: tuple[bytes, int]) -> bytes:
    data, length = payload
    async with session.post(url, data=data, headers={HEADER: str(length)}) as resp:
        content = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {content[:200]!r}")
        start = int(resp.headers.get(HEADER, len(content)))
        return content[start:]  # the binary output (empty for JSON outputs)


async def ensemble_frame(session: aiohttp.ClientSession, base: str, frame: bytes) -> None:
    raw = struct.pack("<I", len(frame)) + frame
    await post(
        session,
        f"{base}/v2/models/image_classifier/infer",
        body("IMAGE", "BYTES", [1, 1], raw, "LABELS", False),
    )


async def client_frame(session: aiohttp.ClientSession, base: str, frame: bytes) -> None:
    raw = struct.pack("<I", len(frame)) + frame
    pixels = await post(
        session,
        f"{base}/v2/models/preprocess/infer",
        body("IMAGE", "BYTES", [1, 1], raw, "PIXELS", True),
    )
    probs = await post(
        session,
        f"{base}/v2/models/classifier/infer",
        body("input", "FP32", [1, 3, 224, 224], pixels, "output", True),
    )
    await post(
        session,
        f"{base}/v2/models/postprocess/infer",
        body("PROBS", "FP32", [1, 1000], probs, "LABELS", False),
    )


async def measure(base: str, kind: str, frame: bytes, workers: int, seconds: float) -> float:
    call = ensemble_frame if kind == "ensemble" else client_frame
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=workers)) as session:
        await call(session, base, frame)  # warm the connection and the models
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                await call(session, base, frame)
                done += 1

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(workers)))
        return done / (time.monotonic() - start)


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (240, 320, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG")
    frame = buf.getvalue()
    rows: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        modelgen.write_demo_repository(Path(tmp))
        port = free_port()
        command = [sys.executable, "-m", "appliance", "serve", "--model-repository", tmp]
        command += ["--http-port", str(port), "--metrics-port", "-1", "--grpc-port", "-1"]
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc)
            for workers in args.concurrency:
                results: dict[str, Any] = {}
                for kind in ("ensemble", "client"):
                    print(f"concurrency {workers}: {kind} ...", file=sys.stderr, flush=True)
                    results[kind] = asyncio.run(measure(base, kind, frame, workers, args.seconds))
                rows.append((workers, results["ensemble"], results["client"]))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nimage_classifier, 320x240 JPEG frames, {args.seconds:g}s per point")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {cpus} CPU(s), "
        f"Python {platform.python_version()}\n"
    )
    print("| concurrency | ensemble frames/s | 3 client calls frames/s | ratio |")
    print("|---:|---:|---:|---:|")
    for workers, ens, cli in rows:
        print(f"| {workers} | {ens:.1f} | {cli:.1f} | {ens / cli:.2f}x |")


if __name__ == "__main__":
    main()
