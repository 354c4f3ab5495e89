"""The dynamic batcher alone, on several source trees: latency percentiles and batch
sizes when the event loop is the bottleneck, as it is under HTTP load.

A benchmark, not a test. For each tree (``--tree DIR``, repeatable; this checkout is
always one) a subprocess imports that tree's batcher, instances, statistics and ONNX
Runtime backend, builds one instance of the 256-1024-1024-10 MLP, and runs
``--clients`` closed-loop callers on its event loop for ``--seconds``. Each caller
spends ``--loop-us`` of pure-Python work holding the GIL before it submits (the
request's parse and decode) and as much after its answer (the encode and write),
as an HTTP handler would, so the loop, not the engine, sets the pace; then
submits again at once. Trees alternate over ``--repeats``.

Reported per run: answers/s, the submit-to-answer latency (p50/p90/p99) and the
whole caller cycle's, the batch sizes (mean and share of batches of at most 2 rows)
and the instance thread's CPU per batch. Only the scheduler differs between trees:
same model, same engine, same emulated load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

WORKER = r"""
import asyncio, json, sys, threading, time
from pathlib import Path
import numpy as np
args = json.loads(sys.argv[1])
try:  # the layout since the package split (appliance/core)
    from appliance.core.batcher import DynamicBatcher
    from appliance.core.batching import BatchPolicy
    from appliance.core.instances import InstanceGroup
    from appliance.core.stats import ModelStats
except ImportError:  # the flat layout of older trees
    from appliance.batcher import BatchPolicy, DynamicBatcher
    from appliance.instances import InstanceGroup
    from appliance.stats import ModelStats
from appliance.backends.base import BackendOptions
from appliance.backends.onnxruntime_backend import OnnxRuntimeBackend


def spin(us):
    end = time.perf_counter() + us / 1e6
    x = 0
    while time.perf_counter() < end:
        x += 1


async def main():
    path = Path(args["model"])
    def factory(index):
        return OnnxRuntimeBackend(BackendOptions(path, index, 1, threads=args["threads"]))
    group = await InstanceGroup.create("mlp", 1, factory)
    policy = BatchPolicy(args["max_batch"], (), args["delay_us"] / 1e6, True)
    stats = ModelStats("mlp", "1")
    batcher = DynamicBatcher("mlp", group, policy, 1024, stats)
    row = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    waits, cycles = [], []
    stop_at = time.perf_counter() + args["warmup"] + args["seconds"]
    measure_from = time.perf_counter() + args["warmup"]
    tid = []
    async def client():
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            spin(args["loop_us"])
            t1 = time.perf_counter()
            await batcher.submit({"input": row}, ("output",), 1, (256,), None)
            t2 = time.perf_counter()
            spin(args["loop_us"])
            t3 = time.perf_counter()
            if t0 >= measure_from:
                waits.append(t2 - t1)
                cycles.append(t3 - t0)
    await asyncio.sleep(0.2)
    # the instance's thread: the one thread named after the model
    threads = {t.native_id: t.name for t in threading.enumerate()}
    inst = next(n for n, name in threads.items() if name.startswith("mlp"))
    def thread_cpu():
        fields = Path(f"/proc/self/task/{inst}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100.0
    tasks = [asyncio.ensure_future(client()) for _ in range(args["clients"])]
    await asyncio.sleep(args["warmup"])
    e0, n0, c0 = stats.execution_count, stats.inference_count, thread_cpu()
    small0 = 0
    await asyncio.gather(*tasks)
    e1, n1, c1 = stats.execution_count, stats.inference_count, thread_cpu()
    await batcher.stop(5)
    await group.close()
    w = np.array(waits) * 1e3
    c = np.array(cycles) * 1e3
    print(json.dumps({
        "answers_s": len(waits) / args["seconds"],
        "wait": [float(np.percentile(w, q)) for q in (50, 90, 99)],
        "cycle": [float(np.percentile(c, q)) for q in (50, 90, 99)],
        "batch": (n1 - n0) / max(1, e1 - e0),
        "thread_ms_per_batch": (c1 - c0) * 1e3 / max(1, e1 - e0),
    }))

asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", default=[])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--loop-us", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--queue-delay-us", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from devtools import modelgen

    work = Path(tempfile.mkdtemp(prefix="bench-sched-"))
    model = work / "mlp.onnx"
    model.write_bytes(modelgen.mlp(256, 1024, 10))
    args = {
        "model": str(model),
        "clients": a.clients,
        "loop_us": a.loop_us,
        "seconds": a.seconds,
        "warmup": a.warmup,
        "max_batch": a.max_batch_size,
        "delay_us": a.queue_delay_us,
        "threads": a.threads,
    }
    trees = [HERE, *(t.resolve() for t in a.tree)]
    print(
        f"clients {a.clients}, {a.loop_us:.0f} us of loop work before and after each "
        f"request, max_batch_size {a.max_batch_size}, delay {a.queue_delay_us} us, "
        f"{a.threads} intra-op threads\n"
    )
    print(
        "| repeat | tree | answers/s | wait p50/p90/p99 ms | cycle p50/p90/p99 ms "
        "| avg batch | instance CPU ms/batch | load (1 min) |"
    )
    print("|---|---|---:|---|---|---:|---:|---:|")
    for rep in range(a.repeats):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(
                [sys.executable, "-c", WORKER, json.dumps(args)],
                cwd=tree, env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {rep + 1} | {_name(tree)} | {r['answers_s']:,.0f} | "
                + "/".join(f"{x:.2f}" for x in r["wait"])
                + " | "
                + "/".join(f"{x:.2f}" for x in r["cycle"])
                + f" | {r['batch']:.1f} | {r['thread_ms_per_batch']:.2f} | "
                f"{os.getloadavg()[0]:.2f} |",
                flush=True,
            )
            time.sleep(0.5)
    return 0


def _name(tree: Path) -> str:
    rev = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return (rev or tree.name) + ("+" if dirty else "") + (" (this tree)" if tree == HERE else "")


if __name__ == "__main__":
    asyncio.run(asyncio.sleep(0))
    sys.exit(main())
