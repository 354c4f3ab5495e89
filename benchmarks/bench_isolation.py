"""What process isolation costs: the same Python model in the server process vs in a
worker process (``parameters: {execution: process}``).

A benchmark, not a test. Both copies of an identity Python model (one FP32 input
returned as its output, one instance, no batching) are served by one
``InProcessServer``, so the figures show the isolation's own cost (the copy into the
shared segment, the control round trip through the worker, the copy out) without
HTTP in the way. For each tensor size (64 B and 1 MiB) and client concurrency (1
and 8; requests queue for the one instance), N asyncio tasks loop for
``--seconds`` and every request's latency is recorded. The report (markdown) starts
with the machine table.

Run: ``python benchmarks/bench_isolation.py [--seconds 5] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

import machine  # noqa: E402

from appliance import InProcessServer  # noqa: E402

MODEL_PY = """
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", r.inputs()[0].as_numpy())])
                for r in requests]
"""

CONFIG = """
backend: python
max_batch_size: 0
parameters: {{execution: {execution}}}
input: [{{name: IN, data_type: TYPE_FP32, dims: [-1]}}]
output: [{{name: OUT, data_type: TYPE_FP32, dims: [-1]}}]
"""

MODES = {"in-process": "in_process", "process": "process"}
SIZES = {"64 B": 16, "1 MiB": 2**18}  # FP32 elements


def write_repository(root: Path) -> None:
    for execution in MODES.values():
        version = root / f"echo_{execution}" / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(textwrap.dedent(MODEL_PY))
        (version.parent / "config.yaml").write_text(CONFIG.format(execution=execution))


async def run_point(
    server: InProcessServer, model: str, data: np.ndarray, concurrency: int, seconds: float
) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) for ``concurrency`` tasks looping ``seconds``."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            out = await server.infer(model, {"IN": data})
            latencies.append(time.perf_counter() - start)
            assert out["OUT"].shape == data.shape

    begun = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - begun
    ms = np.array(latencies) * 1e3
    return len(latencies) / elapsed, float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


async def main(seconds: float) -> str:
    info = machine.describe("numpy")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_repository(Path(tmp))
        async with InProcessServer(tmp) as server:
            for label, elements in SIZES.items():
                data = np.random.default_rng(0).random(elements, dtype=np.float32)
                for concurrency in (1, 8):
                    point = {}
                    for mode, execution in MODES.items():
                        model = f"echo_{execution}"
                        await run_point(server, model, data, concurrency, min(1.0, seconds))
                        point[mode] = await run_point(server, model, data, concurrency, seconds)
                    rows.append((label, concurrency, point))
    lines = [
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items()),
        "",
        "| tensor | concurrency | in-process req/s | p50 ms | p99 ms "
        "| process req/s | p50 ms | p99 ms | process/in-process throughput |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, concurrency, point in rows:
        a, b = point["in-process"], point["process"]
        lines.append(
            f"| {label} | {concurrency} | {a[0]:.0f} | {a[1]:.3f} | {a[2]:.3f} "
            f"| {b[0]:.0f} | {b[1]:.3f} | {b[2]:.3f} | {b[0] / a[0]:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measured point")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    report = asyncio.run(main(args.seconds))
    print(report)
    if args.out:
        args.out.write_text(report)
