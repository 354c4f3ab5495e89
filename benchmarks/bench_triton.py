"""The appliance against the real NVIDIA Triton Inference Server, on the same CPU, with
Triton's own load generator.

A benchmark, not a test. One command::

    python benchmarks/bench_triton.py            # ~4 minutes; --help for the knobs

It lays out Triton 2.51 from the ``nvidia-pytriton`` wheel and perf_analyzer from the
``perf-analyzer`` wheel (``triton_layout.py``; cached after the first run, or
``--perf-analyzer PATH``), writes the same two models for every server (the
256-1024-1024-10 MLP and Triton's ``simple`` INT32 add/sub, ``max_batch_size: 8``,
dynamic batching with the same queue delay, one instance, the same ONNX Runtime
threads), starts the servers and runs perf_analyzer (batch 1) against each in turn,
ABC..CBA order at every point (Triton, appliance, appliance, Triton, ...).

Which Triton: the wheel has only Triton's Python backend, so by default Triton runs
each model as a Python-backend model calling ONNX Runtime in-process (a stub process
and a shared-memory hop per request): the report calls it "Triton (Python backend)".
Triton as deployed serves ONNX with its native ONNX Runtime backend
(``libtriton_onnxruntime.so``), which the wheel lacks. ``--triton-backend-dir DIR``
names a folder holding ``onnxruntime/libtriton_onnxruntime.so`` (with its
``libonnxruntime.so``), a backend you built from Triton's onnxruntime_backend sources
at the branch of the wheel's Triton (r24.10 for 2.51); the same ``tritonserver`` then
also serves the models with it (``platform: "onnxruntime_onnx"``, ``--backend-directory
DIR``), and the report has all three servers side by side. Nothing here builds
Triton's code.

Per run: throughput, p50 and p99 latency (perf_analyzer's), server CPU per request
(utime+stime of the whole server process tree over the run, Triton's stub processes
included, divided by the requests its statistics counted), perf_analyzer's own CPU per
request (client and servers share the cores), average batch size (its statistics'
inferences per execution), and the load of everything else on the machine during the
run (busy CPU of the machine minus both servers' trees and the client, in cores).
``--py-spy DIR`` records a profile of the appliance at every point (``spy_summary.py``
reads them); sampling costs the server CPU, so take figures from a run without it.
The report keeps every run and the median per point, and is written to
``benchmarks/results/<date>-triton[-<label>].md``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton_layout
from machine import describe
from probes import free_port, installed_env
from triton_report import LABELS, report

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from devtools import modelgen  # noqa: E402

# (model, protocol, concurrency): the six points and the two concurrency-1 simples
POINTS = [
    ("mlp", "http", 1),
    ("mlp", "http", 8),
    ("mlp", "grpc", 1),
    ("mlp", "grpc", 8),
    ("simple", "http", 1),
    ("simple", "http", 8),
    ("simple", "grpc", 1),
    ("simple", "grpc", 8),
]

CONFIG = """\
name: "{name}"{platform}
backend: "{backend}"
max_batch_size: 8
input [
{inputs}
]
output [
{outputs}
]
dynamic_batching {{ max_queue_delay_microseconds: {delay} }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value {{ string_value: "{threads}" }} }}
"""
TENSORS = {
    "mlp": ([("input", "TYPE_FP32", 256)], [("output", "TYPE_FP32", 10)]),
    "simple": (
        [("INPUT0", "TYPE_INT32", 16), ("INPUT1", "TYPE_INT32", 16)],
        [("OUTPUT0", "TYPE_INT32", 16), ("OUTPUT1", "TYPE_INT32", 16)],
    ),
}


def _tensors(rows: list[tuple[str, str, int]]) -> str:
    return ",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: [ {d} ] }}' for n, t, d in rows)


def write_repositories(work: Path, threads: int, delay_us: int) -> tuple[Path, Path, Path]:
    """The same models for every server: (appliance repository, Triton Python-backend
    repository, Triton native ONNX Runtime backend repository)."""
    graphs = {"mlp": modelgen.mlp(256, 1024, 10), "simple": modelgen.simple_add_sub()}
    repos = work / "appliance", work / "triton", work / "triton-ort"
    for repo, backend in zip(repos, ("onnxruntime", "python", "native"), strict=True):
        for name, graph in graphs.items():
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "1" / "model.onnx").write_bytes(graph)
            ins, outs = TENSORS[name]
            (repo / name / "config.pbtxt").write_text(
                CONFIG.format(
                    name=name,
                    platform='\nplatform: "onnxruntime_onnx"' if backend == "native" else "",
                    backend="onnxruntime" if backend == "native" else backend,
                    inputs=_tensors(ins),
                    outputs=_tensors(outs),
                    delay=delay_us,
                    threads=threads,
                )
            )
            if backend == "python":
                model = triton_layout.python_model("model.onnx", threads)
                (repo / name / "1" / "model.py").write_text(model)
    return repos


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    http: int
    grpc: int
    ready_s: float

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.http if protocol == 'http' else self.grpc}"

    def stats(self, model: str) -> tuple[int, int, int]:
        """(successes, inferences, executions) the server counted for ``model``."""
        url = f"http://127.0.0.1:{self.http}/v2/models/{model}/stats"
        with urllib.request.urlopen(url, timeout=10) as r:
            rows = json.load(r)["model_stats"]
        return (
            sum(int(m["inference_stats"]["success"]["count"]) for m in rows),
            sum(int(m["inference_count"]) for m in rows),
            sum(int(m["execution_count"]) for m in rows),
        )


def start(
    name: str, cmd: list[str], env: dict[str, str], http: int, grpc: int, log: Path
) -> Server:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited: {log.read_text()[-3000:]}")
        try:
            url = f"http://127.0.0.1:{http}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    ready = time.monotonic() - t0
                    print(f"{name} ready in {ready:.2f} s", file=sys.stderr)
                    return Server(name, proc, http, grpc, ready)
        except OSError:
            pass
        time.sleep(0.01)  # (as bench_startup.py: a coarser poll adds up to its step)
    proc.kill()
    raise SystemExit(f"{name} not ready after 180 s: {log.read_text()[-3000:]}")


def tree_cpu(pid: int, rss: bool = False) -> float:
    """utime+stime (s) of ``pid`` and every live descendant (``rss``: their resident
    memory in MiB instead)."""
    parent: dict[int, int] = {}
    own: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    pages = os.sysconf("SC_PAGE_SIZE") / 2**20
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        cpu = (int(fields[11]) + int(fields[12])) / tick
        own[int(entry.name)] = int(fields[21]) * pages if rss else cpu
    total = 0.0
    for p, cpu in own.items():
        q = p
        while q > 1 and q != pid:
            q = parent.get(q, 0)
        if q == pid:
            total += cpu
    return total


def busy_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def profiler(pid: int, folder: Path, point: tuple[str, str, int]) -> subprocess.Popen[bytes]:
    """py-spy sampling the appliance (every thread, idle ones left out, without pausing
    it) during one run; collapsed stacks by function into ``folder``. Sampling still
    costs the server some CPU: take figures from a run without ``--py-spy``."""
    folder.mkdir(parents=True, exist_ok=True)
    name = "-".join(str(x) for x in point)
    out = folder / f"{name}.txt"
    n = 1
    while out.exists():
        n += 1
        out = folder / f"{name}-{n}.txt"
    cmd = ["py-spy", "record", "-p", str(pid), "--format", "raw", "--function",
           "--nonblocking", "--rate", "250", "-o", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_point(
    pa: list[str], server: Server, others: list[Server], point: tuple[str, str, int], args: Any
) -> dict[str, Any]:
    model, protocol, concurrency = point
    with tempfile.NamedTemporaryFile(suffix=".csv") as report:
        cmd = [
            *pa,
            "-m", model,
            "-u", server.url(protocol),
            "-i", protocol,
            "--concurrency-range", str(concurrency),
            "--measurement-interval", str(args.interval_ms),
            "--stability-percentage", "1000",
            "--max-trials", "3",
            "-f", report.name,
        ]  # fmt: skip
        before_stats = server.stats(model)
        cpu0, others0, busy0 = (
            tree_cpu(server.proc.pid),
            sum(tree_cpu(o.proc.pid) for o in others),
            busy_cpu(),
        )
        child0 = os.times()
        t0 = time.monotonic()
        spy = None
        if args.py_spy and server.name == "appliance":
            spy = profiler(server.proc.pid, args.py_spy, point)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled so far
            spy.wait(60)
        wall = time.monotonic() - t0
        child1 = os.times()
        cpu1, others1, busy1 = (
            tree_cpu(server.proc.pid),
            sum(tree_cpu(o.proc.pid) for o in others),
            busy_cpu(),
        )
        after_stats = server.stats(model)
        if done.returncode != 0:
            raise SystemExit(f"perf_analyzer failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        rows = list(csv.DictReader(Path(report.name).read_text().splitlines()))
    row = rows[-1]
    client = (child1.children_user + child1.children_system) - (
        child0.children_user + child0.children_system
    )
    served = after_stats[0] - before_stats[0]
    executions = after_stats[2] - before_stats[2]
    server_cpu = cpu1 - cpu0
    rest = (busy1 - busy0) - server_cpu - (others1 - others0) - client
    return {
        "server": server.name,
        "infer_s": float(row["Inferences/Second"]),
        "p50_ms": int(row["p50 latency"]) / 1000,
        "p99_ms": int(row["p99 latency"]) / 1000,
        "cpu_ms": 1000 * server_cpu / max(served, 1),
        "client_ms": 1000 * client / max(served, 1),
        "batch": (after_stats[1] - before_stats[1]) / max(executions, 1),
        "others_cores": max(rest, 0.0) / wall,
        "uptime": "/".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--perf-analyzer", help="perf_analyzer command (default: the PyPI wheel)")
    ap.add_argument("--points", default="all", help="e.g. mlp:http:8,simple:grpc:8")
    ap.add_argument("--repeats", type=int, default=2, help="runs per server per point (ABBA)")
    ap.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer window")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--queue-delay-us", type=int, default=100)
    ap.add_argument("--only", choices=list(LABELS), help="measure one server")
    ap.add_argument(
        "--triton-backend-dir",
        type=Path,
        help="folder with onnxruntime/libtriton_onnxruntime.so (built by you from Triton's "
        "onnxruntime_backend sources): also measure Triton with its native ONNX Runtime "
        "backend",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also measure the Python floor (floor_server.py) on the HTTP points",
    )
    ap.add_argument("--label", default="", help="a name for this tree in the report")
    ap.add_argument("--py-spy", type=Path, help="record py-spy profiles of the appliance here")
    args = ap.parse_args()
    points = POINTS
    if args.points != "all":
        points = [(m, p, int(c)) for m, p, c in (x.split(":") for x in args.points.split(","))]
    machine = describe("onnxruntime", "grpcio", "aiohttp", "numpy")
    pa = args.perf_analyzer.split() if args.perf_analyzer else triton_layout.perf_analyzer()
    triton = triton_layout.Triton()
    native = triton_layout.native_backends(args.triton_backend_dir)
    optional = {"triton-ort": bool(native), "floor": args.floor or args.only == "floor"}
    wanted = [n for n in LABELS if (args.only or n) == n and optional.get(n, True)]
    if not wanted:
        raise SystemExit("--only triton-ort needs --triton-backend-dir")
    idle: dict[str, tuple[float, float]] = {}
    servers: list[Server] = []
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        work = Path(tmp)
        ours, theirs, native_repo = write_repositories(work, args.threads, args.queue_delay_us)
        try:
            for name, repo, backends in (
                ("triton-ort", native_repo, native),
                ("triton", theirs, None),
            ):
                if name not in wanted:
                    continue
                h, g, m = free_port(), free_port(), free_port()
                servers.append(
                    start(name, triton.command(repo, h, g, m, backends), triton.env(backends),
                          h, g, work / f"{name}.log")
                )  # fmt: skip
            if "appliance" in wanted:
                h, g, m = free_port(), free_port(), free_port()
                cmd = [
                    sys.executable, "-m", "appliance", "serve",
                    "--model-repository", str(ours),
                    "--http-port", str(h), "--grpc-port", str(g), "--metrics-port", str(m),
                    "--log-level", "warning",
                ]  # fmt: skip
                env = installed_env(ROOT)  # its bytecode compiled, as installed
                servers.append(start("appliance", cmd, env, h, g, work / "appliance.log"))
            if "floor" in wanted:
                h = free_port()
                cmd = [sys.executable, str(ROOT / "benchmarks" / "floor_server.py"), str(ours),
                       "--http-port", str(h), "--threads", str(args.threads)]  # fmt: skip
                servers.append(start("floor", cmd, dict(os.environ), h, 0, work / "floor.log"))
            time.sleep(3.0)  # idle, then each server's resident memory
            idle.update({s.name: (s.ready_s, tree_cpu(s.proc.pid, rss=True)) for s in servers})
            for point in points:
                order = []
                for r in range(args.repeats):
                    order += servers if r % 2 == 0 else servers[::-1]
                for server in order:
                    if server.name == "floor" and point[1] != "http":
                        continue  # the floor answers HTTP only
                    others = [s for s in servers if s is not server]
                    got = run_point(pa, server, others, point, args)
                    results.setdefault(point, []).append(got)
                    print(point, json.dumps(got), file=sys.stderr, flush=True)
        finally:
            for s in servers:
                s.proc.send_signal(signal.SIGTERM)
            for s in servers:
                try:
                    s.proc.wait(30)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
    text = report(machine, results, args, pa, idle)
    print(text)
    tag = "".join(c if c.isalnum() else "-" for c in args.label.split()[0]) if args.label else ""
    name = f"{datetime.date.today()}-triton{'-' + tag if tag else ''}.md"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(text)
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
