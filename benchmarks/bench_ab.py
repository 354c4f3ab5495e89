"""Before/after in one run: the same load on two source trees, alternated.

A benchmark, not a test. ``--baseline DIR`` is another copy of the project (e.g.
``git archive <commit> | tar -x -C /tmp/base``); the other side is this checkout.
Both serve their own demo repository on free loopback ports at the same time; each
repeat runs ``appliance perf`` (this checkout's) against one side then the other,
JSON and binary bodies over HTTP (or, with ``--transport grpc``, gRPC calls), and
reads the server's CPU time per answered request from ``/proc`` and the statistics
extension. Alternating keeps machine noise on both sides alike. Markdown rows on
stdout; servers stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from probes import cpu_seconds, free_port, successes

HERE = Path(__file__).resolve().parent.parent


def serve(
    tree: Path, port: int, grpc_port: int, log: Path, repo: Path | None
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "appliance", "serve", "--http-port", str(port),
           "--grpc-port", str(grpc_port), "--metrics-port", "-1",
           "--log-level", "warning"]  # fmt: skip
    if repo is not None:  # else each side serves its own demo models
        cmd += ["--model-repository", str(repo)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other source tree")
    ap.add_argument("--model", default="classifier")
    ap.add_argument("--transport", choices=["http", "grpc"], default="http")
    ap.add_argument("--modes", default="json,binary", help="HTTP bodies (ignored for gRPC)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--model-repository",
        type=Path,
        help="serve this repository on both sides (default: each side's demo models; "
        "e.g. the repository benchmarks/bench_http.py writes, for its mlp and classifier)",
    )
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    sides = {}
    grpc = a.transport == "grpc"
    modes = ["grpc"] if grpc else a.modes.split(",")
    for name, tree in (("baseline", a.baseline.resolve()), ("this tree", HERE)):
        port, gport = free_port(), free_port() if grpc else -1
        log = work / f"{port}.log"
        sides[name] = (serve(tree, port, gport, log, a.model_repository), port, gport)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    out = work / "p.json"
    try:
        time.sleep(12)  # both load their demo models
        print("| repeat | side | body | infer/s | p50 ms | p99 ms | server CPU us/req |")
        print("|---|---|---|---|---|---|---|")
        for rep in range(a.repeats):
            for name, (proc, port, gport) in sides.items():
                for mode in modes:
                    c0, n0 = cpu_seconds(proc.pid), successes(f"127.0.0.1:{port}", a.model)
                    cmd = [sys.executable, "-m", "appliance", "perf", "-m", a.model,
                           "-u", f"127.0.0.1:{port}", "--concurrency", str(a.concurrency),
                           "--warmup", "1", "--duration", str(a.seconds), "--quiet",
                           "--json", str(out)]  # fmt: skip
                    cmd += ["--json-data"] if mode == "json" else []
                    cmd += ["-i", "grpc", "--grpc-url", f"127.0.0.1:{gport}"] if grpc else []
                    subprocess.run(cmd, env=env, check=True, timeout=600)
                    c1, n1 = cpu_seconds(proc.pid), successes(f"127.0.0.1:{port}", a.model)
                    p = json.loads(out.read_text())["points"][0]
                    print(
                        f"| {rep + 1} | {name} | {mode} | {p['throughput_infer_s']:.0f} "
                        f"| {p['p50_ms']:.1f} | {p['p99_ms']:.1f} "
                        f"| {(c1 - c0) * 1e6 / max(1, n1 - n0):.0f} |",
                        flush=True,
                    )
    finally:
        for proc, _, _ in sides.values():
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
