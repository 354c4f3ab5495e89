"""The latency tail of dynamic batching under wrk, on several source trees, alternated.

A benchmark, not a test. Each tree (``--tree DIR``, repeatable: other checkouts of the
project, e.g. ``git worktree add --detach /tmp/base 3f6911a``; this checkout is always
one of them) serves the same repository: the 256-1024-1024-10 MLP with dynamic
batching (``--max-batch-size``, ``--queue-delay-us``, one instance by default), on its
own free loopback port. Each repeat runs wrk (Debian's ``wrk``, with a Lua script
that POSTs one binary-extension request) against each tree in turn, so machine noise
falls on every side alike, and reads:

- wrk's requests/s and latency percentiles (p50, p90, p99);
- the server's CPU time per answered request (``/proc``) and the average batch size
  (the statistics extension: inferences / executions);
- the load average and the CPU other processes used meanwhile.

Markdown rows on stdout (and ``--out FILE``); servers stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import orjson

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # run from a checkout without installing

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)
from probes import cpu_seconds, free_port  # noqa: E402

from devtools import modelgen  # noqa: E402

MODEL = "mlp"
HEADER = "Inference-Header-Content-Length"

LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["{header}"] = "{length}"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
"""


def config(max_batch: int, delay_us: int, instances: int, threads: int) -> str:
    lines = [
        "backend: onnxruntime",
        f"max_batch_size: {max_batch}",
        "input: [{name: input, data_type: TYPE_FP32, dims: [256]}]",
        "output: [{name: output, data_type: TYPE_FP32, dims: [10]}]",
        f"instance_group: [{{count: {instances}, kind: KIND_CPU}}]",
        f"dynamic_batching: {{max_queue_delay_microseconds: {delay_us}}}",
    ]
    if threads:
        lines.append(f"parameters: {{intra_op_thread_count: '{threads}'}}")
    return "\n".join(lines) + "\n"


def request_body() -> tuple[bytes, int]:
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 256],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    return header + x.tobytes(), len(header)


def serve(tree: Path, port: int, repo: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "appliance", "serve", "--model-repository", str(repo),
           "--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1",
           "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb")
    )


def wait_ready(port: int, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready", timeout=2
            ) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server on port {port} never became ready")


def model_counts(port: int) -> tuple[int, int]:
    """(inferences, executions) of the model so far."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/v2/models/{MODEL}/stats", timeout=10
    ) as r:
        rows = json.load(r)["model_stats"]
    return (
        sum(int(row["inference_count"]) for row in rows),
        sum(int(row["execution_count"]) for row in rows),
    )


def busy_ticks() -> int:
    """CPU ticks (user+nice+system) of the whole machine so far."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return int(fields[0]) + int(fields[1]) + int(fields[2])


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"unexpected wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str) -> dict[str, float]:
    found = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.MULTILINE)
        found[f"p{pct}"] = _ms(m.group(1)) if m else float("nan")
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    found["errors"] = float(m.group(1)) if m else 0.0
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another tree")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--queue-delay-us", type=int, default=500)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--intra-op-threads", type=int, default=0, help="0: the server's rule")
    ap.add_argument("--out", type=Path, help="also write the report here")
    a = ap.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-tail-"))
    repo = work / "models"
    modelgen.write_model(
        repo,
        MODEL,
        modelgen.mlp(256, 1024, 10),
        config(a.max_batch_size, a.queue_delay_us, a.instances, a.intra_op_threads),
    )
    body, length = request_body()
    (work / "body.bin").write_bytes(body)
    script = work / "post.lua"
    script.write_text(LUA.format(header=HEADER, length=length, body=work / "body.bin"))
    trees = [HERE, *(t.resolve() for t in a.tree)]
    names = {tree: _describe_tree(tree) for tree in trees}
    sides: dict[Path, tuple[subprocess.Popen[bytes], int]] = {}
    rows: list[str] = []
    try:
        for tree in trees:
            port = free_port()
            sides[tree] = (serve(tree, port, repo, work / f"{port}.log"), port)
        for _, port in sides.values():
            wait_ready(port)
        head = [
            f"# Dynamic batching tail under wrk, {time.strftime('%Y-%m-%d %H:%M:%S')}",
            "",
            "```",
            " ".join(["python3", "benchmarks/bench_tail.py", *sys.argv[1:]]),
            "```",
            "",
            "| | |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in describe("onnxruntime", "aiohttp").items()),
            "",
            f"Model: MLP 256-1024-1024-10, max_batch_size {a.max_batch_size}, "
            f"max_queue_delay {a.queue_delay_us} us, {a.instances} instance(s); wrk "
            f"{a.threads} threads, {a.connections} connections, {a.seconds} s a point, "
            "binary-extension body.",
            "",
            "| repeat | tree | infer/s | p50 ms | p90 ms | p99 ms | server CPU us/req "
            "| avg batch | other CPU (cores) | load (1 min) | non-2xx |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        print("\n".join(head), flush=True)
        for rep in range(a.repeats):
            for tree, (proc, port) in sides.items():
                url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"
                base = [wrk, "-t", str(a.threads), "-c", str(a.connections), "-s", str(script)]
                subprocess.run([*base, "-d", "2s", url], capture_output=True)  # warm-up
                cmd = [*base, "-d", f"{a.seconds}s", "--latency", url]
                n0, e0 = model_counts(port)
                c0, b0, t0 = cpu_seconds(proc.pid), busy_ticks(), time.monotonic()
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
                c1, b1, t1 = cpu_seconds(proc.pid), busy_ticks(), time.monotonic()
                n1, e1 = model_counts(port)
                w = parse_wrk(out)
                server_s = c1 - c0
                wrk_and_rest = (b1 - b0) / os.sysconf("SC_CLK_TCK") - server_s
                other = max(0.0, wrk_and_rest) / (t1 - t0)
                row = (
                    f"| {rep + 1} | {names[tree]} | {w['rps']:,.0f} | {w['p50']:.2f} | "
                    f"{w['p90']:.2f} | {w['p99']:.2f} | "
                    f"{server_s * 1e6 / max(1, n1 - n0):.0f} | "
                    f"{(n1 - n0) / max(1, e1 - e0):.1f} | {other:.2f} | "
                    f"{os.getloadavg()[0]:.2f} | {w['errors']:.0f} |"
                )
                rows.append(row)
                print(row, flush=True)
    finally:
        for proc, _ in sides.values():
            proc.terminate()
        for proc, _ in sides.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if a.out is not None:
        a.out.write_text("\n".join(head + rows) + "\n")
    return 0


def _describe_tree(tree: Path) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return tree.name
    return f"{rev}{'+' if dirty else ''}" + (" (this tree)" if tree == HERE else "")


if __name__ == "__main__":
    sys.exit(main())
