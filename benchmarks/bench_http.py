"""HTTP throughput and latency of the appliance against the in-process ONNX Runtime ceiling.

A benchmark, not a test. For each model (``classifier``: FP32 [-1,3,224,224] ->
[-1,1000]; ``mlp``: FP32 [-1,256] -> [-1,16]) it measures:

1. the ceiling: rows/s of ONNX Runtime called directly in this process, through
   the server's own backend class (so the session options are the server's:
   intra-op threads = all usable cores for one instance), over a batch-size sweep;
2. the server over KServe v2 HTTP with the binary tensor extension, one row per
   request, at several client concurrencies, once with dynamic batching
   (``<model>_batched``) and once without (``<model>_nobatch``: max_batch_size
   set but no ``dynamic_batching`` section, so every request executes alone);
3. the HTTP floor: the same load against a bare aiohttp app that does no inference,
   i.e. what HTTP alone costs on this machine (skip with ``--no-floor``).

Every measurement also records the CPU that other processes took meanwhile; on a
shared machine a disturbed measurement is taken again, within bounds (``--retries``,
``--quiet-budget``), and flagged "(noisy)" in the report if it stays disturbed.

The server runs as a subprocess (``python -m appliance serve``) on a free loopback
port with its own temporary model repository, and is stopped with SIGTERM at the
end, also on error. The load generator is aiohttp with request bodies encoded once,
N workers each looping; every loop is bounded by a time limit and a request count.

Run ``python benchmarks/bench_http.py --help`` for the options; docs/benchmarks.md
explains the columns. Results are printed as markdown and written to
``benchmarks/results/<date>-http.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import numpy as np
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)
from probes import cpu_seconds, free_port  # noqa: E402

from appliance.backends.base import BackendOptions  # noqa: E402
from appliance.backends.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from appliance.core.instances import cpu_share  # noqa: E402
from devtools import modelgen  # noqa: E402

HEADER_LENGTH = "Inference-Header-Content-Length"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    """Progress goes to stderr so stdout stays the clean markdown report."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- models and their configs -------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], bytes]
    row_shape: tuple[int, ...]  # one row, without the batch dim
    out_dims: tuple[int, ...]


MODELS = {
    "classifier": ModelSpec("classifier", modelgen.classifier, (3, 224, 224), (1000,)),
    "mlp": ModelSpec("mlp", modelgen.mlp, (256,), (16,)),
}


def config_yaml(
    spec: ModelSpec,
    batched: bool,
    max_batch: int,
    delay_us: int,
    preferred: Sequence[int],
    intra_op_threads: int | None,
) -> str:
    lines = [
        f"# benchmark variant: {'dynamic batching' if batched else 'no dynamic batching'}",
        "backend: onnxruntime",
        f"max_batch_size: {max_batch}",
        "input:",
        f"  - {{name: input, data_type: TYPE_FP32, dims: {list(spec.row_shape)}}}",
        "output:",
        f"  - {{name: output, data_type: TYPE_FP32, dims: {list(spec.out_dims)}}}",
        "instance_group:",
        "  - {count: 1, kind: KIND_CPU}",
    ]
    if intra_op_threads:
        lines += ["parameters:", f"  intra_op_thread_count: '{intra_op_threads}'"]
    if batched:
        lines += ["dynamic_batching:", f"  max_queue_delay_microseconds: {delay_us}"]
        if preferred:
            lines.append(f"  preferred_batch_size: {list(preferred)}")
    return "\n".join(lines) + "\n"


def write_repository(repo: Path, specs: Sequence[ModelSpec], args: argparse.Namespace) -> None:
    for spec in specs:
        model = spec.build()
        for batched in (True, False):
            name = f"{spec.name}_{'batched' if batched else 'nobatch'}"
            modelgen.write_model(
                repo,
                name,
                model,
                config_yaml(
                    spec,
                    batched,
                    args.max_batch_size,
                    args.queue_delay_us,
                    args.preferred,
                    args.intra_op_threads,
                ),
            )


# ---- (a) in-process ONNX Runtime ceiling ---------------------------------------------------


@dataclass
class CeilingPoint:
    batch: int
    calls: int
    seconds: float
    other_cpu_s: float  # CPU time other processes took meanwhile (noise)

    @property
    def rows_per_s(self) -> float:
        return self.calls * self.batch / self.seconds

    @property
    def ms_per_call(self) -> float:
        return self.seconds / self.calls * 1e3


def ceiling_backend(model_path: Path, intra_op_threads: int | None) -> OnnxRuntimeBackend:
    """The server's backend class with the options it would give a single instance."""
    params = {"intra_op_thread_count": str(intra_op_threads)} if intra_op_threads else {}
    return OnnxRuntimeBackend(
        BackendOptions(model_path=model_path, threads=cpu_share(1), parameters=params)
    )


def measure_point(
    backend: OnnxRuntimeBackend, spec: ModelSpec, batch: int, seconds: float, max_calls: int
) -> CeilingPoint:
    """Rows/s of direct ``infer`` calls at one batch size, bounded by time and call count."""
    x = np.random.default_rng(0).standard_normal((batch, *spec.row_shape), dtype=np.float32)
    feed = {"input": x}
    for _ in range(3):  # warm-up: arena growth, first-run kernel selection
        backend.infer(feed, ["output"])
    busy0, own0 = system_busy_s(), time.process_time()
    calls, start = 0, time.perf_counter()
    end = start + seconds
    while calls < max_calls:
        backend.infer(feed, ["output"])
        calls += 1
        if time.perf_counter() >= end:
            break
    elapsed = time.perf_counter() - start
    other = (system_busy_s() - busy0) - (time.process_time() - own0)
    return CeilingPoint(batch, calls, elapsed, max(0.0, other))


class NoiseGuard:
    """Keeps other processes' CPU use out of the figures, within a time budget.

    ``settle`` waits until the whole machine has been nearly idle for one second
    (so it costs one second on a quiet machine); ``retry`` says whether a
    measurement in which other processes took more than ``limit`` cores on
    average should be taken again. Both are bounded
    (total wait, total re-measurements) so a run on a busy box still ends.
    """

    def __init__(self, limit_cores: float, budget_s: float, retries: int) -> None:
        self.limit = limit_cores
        self.budget_s = budget_s
        self.retries_left = retries
        self.waited_s = 0.0
        self.retried = 0

    async def settle(self) -> None:
        if self.waited_s >= self.budget_s:
            return  # budget spent (or 0: never wait); 'other CPU' still shows the noise
        while self.waited_s < self.budget_s:
            busy0, t0 = system_busy_s(), time.perf_counter()
            await asyncio.sleep(1.0)
            elapsed = time.perf_counter() - t0
            if (system_busy_s() - busy0) / elapsed < self.limit:
                return
            self.waited_s += elapsed  # only busy seconds count against the budget
        log(f"machine still busy; quiet-wait budget ({self.budget_s:.0f}s) spent, going on")

    def retry(self, other_cpu_s: float, seconds: float) -> bool:
        if self.retries_left <= 0 or seconds <= 0 or other_cpu_s / seconds <= self.limit:
            return False
        self.retries_left -= 1
        self.retried += 1
        return True


async def measure_ceiling(
    model_path: Path, spec: ModelSpec, args: argparse.Namespace, guard: NoiseGuard
) -> list[CeilingPoint]:
    """The batch-size sweep; a point disturbed by other processes is measured again."""
    backend = ceiling_backend(model_path, args.intra_op_threads)
    points = []
    try:
        await guard.settle()
        for batch in args.batch_sizes:
            for attempt in range(args.retries + 1):
                if attempt:
                    await guard.settle()
                point = measure_point(backend, spec, batch, args.ceiling_seconds, args.max_requests)
                log(
                    f"ceiling {spec.name} batch {batch:>2}: {point.rows_per_s:9.0f} rows/s "
                    f"({point.ms_per_call:.3f} ms/call, other processes "
                    f"{pct(point.other_cpu_s, point.seconds)} CPU)"
                )
                if not guard.retry(point.other_cpu_s, point.seconds):
                    break
            points.append(point)
    finally:
        backend.close()
    return points


# ---- (b) the server over HTTP ---------------------------------------------------------------


def system_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (from /proc/stat): subtracting what the
    server and this process used leaves what *other* processes took during a case."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def proc_status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


# The HTTP floor: a bare aiohttp app that reads each body and answers with a canned
# response of the real size, no decoding, no inference. What it costs per request
# is what aiohttp itself costs on this machine.
BARE_SERVER = """
import json, sys
from aiohttp import web
port, out_bytes = int(sys.argv[1]), json.loads(sys.argv[2])
stats = {"model_stats": [{"execution_count": 0, "inference_count": 0, "batch_stats": []}]}
def body(model):
    header = json.dumps({"model_name": model, "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, out_bytes[model] // 4],
         "parameters": {"binary_data_size": out_bytes[model]}}]}).encode()
    return header + bytes(out_bytes[model]), str(len(header))
bodies = {m: body(m) for m in out_bytes}
async def infer(request):
    await request.read()
    out, length = bodies[request.match_info["model"]]
    return web.Response(body=out, content_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": length})
async def ok(request):
    return web.json_response(stats)
app = web.Application(client_max_size=2**26)
app.router.add_post("/v2/models/{model}/infer", infer)
app.router.add_get("/v2/models/{model}/stats", ok)
app.router.add_get("/v2/health/ready", ok)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


def appliance_command(repo: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "appliance",
        "serve",
        "--model-repository",
        str(repo),
        "--http-port",
        str(port),
        "--metrics-port",
        "-1",
        "--grpc-port",
        "-1",
        "--host",
        "127.0.0.1",
    ]


def bare_command(specs: Sequence[ModelSpec], port: int) -> list[str]:
    out_bytes = {f"{s.name}_nobatch": 4 * int(np.prod(s.out_dims)) for s in specs}
    return [sys.executable, "-c", BARE_SERVER, str(port), orjson.dumps(out_bytes).decode()]


class ServerProcess:
    """A server command as a child process; ``stop`` sends SIGTERM to its PID.

    Every started process is in ``LIVE`` until stopped, so ``main`` can stop
    whatever an error or a signal left running.
    """

    LIVE: ClassVar[set[ServerProcess]] = set()

    def __init__(self, command: list[str], port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.command = command
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.pid = self.proc.pid
        ServerProcess.LIVE.add(self)
        self.ready_s = float("nan")
        self.rss_ready_kib = 0

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        url = f"http://127.0.0.1:{self.port}/v2/health/ready"
        deadline = time.perf_counter() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} before ready; "
                        f"log:\n{self.log_tail()}"
                    )
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            self.ready_s = time.perf_counter() - self.started
                            self.rss_ready_kib = proc_status_kib(self.pid, "VmRSS")
                            return
                    await self._check_models(session)
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.02)
        raise RuntimeError(f"server not ready after {timeout_s:.0f}s; log:\n{self.log_tail()}")

    async def _check_models(self, session: aiohttp.ClientSession) -> None:
        """Fail fast when a model failed to load: the server then never gets ready."""
        url = f"http://127.0.0.1:{self.port}/v2/repository/index"
        async with session.post(url) as resp:
            if resp.status != 200:
                return
            index = orjson.loads(await resp.read())
        failed = [
            f"{m.get('name')}: {m.get('reason')}" for m in index if m.get("state") == "UNAVAILABLE"
        ]
        if failed:
            raise RuntimeError("model(s) failed to load:\n  " + "\n  ".join(failed))

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 40.0) -> int | None:
        """SIGTERM by PID, wait for the graceful shutdown, SIGKILL if it hangs."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log(f"server {self.pid} ignored SIGTERM for {timeout_s:.0f}s; killing it")
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        ServerProcess.LIVE.discard(self)
        return self.proc.returncode


def encode_request(spec: ModelSpec, rng: np.random.Generator) -> tuple[bytes, dict[str, str]]:
    """One row as a binary-extension body, built once and reused for every request."""
    raw = rng.standard_normal((1, *spec.row_shape), dtype=np.float32).tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, *spec.row_shape],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    headers = {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream"}
    return header + raw, headers


@dataclass
class CaseResult:
    model: str
    batching: bool
    concurrency: int
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    other_cpu_s: float = 0.0
    executions: int = 0
    rows_executed: int = 0
    infer_ns: int = 0

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies_s) / self.seconds if self.seconds else 0.0

    @property
    def rows_per_s(self) -> float:
        return self.requests_per_s  # one row per request

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3 if self.latencies_s else 0.0

    @property
    def mean_batch(self) -> float:
        return self.rows_executed / self.executions if self.executions else 0.0

    @property
    def infer_ms_per_call(self) -> float:
        return self.infer_ns / self.executions / 1e6 if self.executions else 0.0


async def model_stats(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, int]:
    async with session.get(f"{base}/v2/models/{model}/stats") as resp:
        doc = orjson.loads(await resp.read())
    stats = doc["model_stats"][0]
    # per-execution engine time from batch_stats: inference_stats.compute_infer is
    # per request (a batch's time counts once for each request in it, as in Triton)
    infer_ns = sum(b["compute_infer"]["ns"] for b in stats["batch_stats"])
    return {
        "executions": stats["execution_count"],
        "rows": stats["inference_count"],
        "infer_ns": infer_ns,
    }


async def run_case(
    server: ServerProcess,
    spec: ModelSpec,
    batching: bool,
    concurrency: int,
    warmup_s: float,
    seconds: float,
    max_requests: int,
) -> CaseResult:
    """Warm up, then measure one (model, batching, concurrency) case.

    Workers run straight through warm-up and measurement so the window is in
    steady state; a request counts when it completes inside the window. The
    window ends at the time limit, or early once ``max_requests`` completed.
    """
    model = f"{spec.name}_{'batched' if batching else 'nobatch'}"
    base = f"http://127.0.0.1:{server.port}"
    url = f"{base}/v2/models/{model}/infer"
    body, headers = encode_request(spec, np.random.default_rng(concurrency))
    out_bytes = 4 * int(np.prod(spec.out_dims))
    result = CaseResult(spec.name, batching, concurrency)
    t_end = float("inf")  # set when the measured window opens
    measuring = False

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal t_end
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            ok, error = False, ""
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    payload = await resp.read()
                    if resp.status != 200:
                        error = f"HTTP {resp.status}: {payload[:200]!r}"
                    else:
                        json_len = int(resp.headers.get(HEADER_LENGTH, "-1"))
                        ok = json_len >= 0 and len(payload) == json_len + out_bytes
                        if not ok:
                            error = f"bad body: {len(payload)} bytes, header {json_len}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            t1 = time.perf_counter()
            if not ok:  # counted in warm-up too: every response must be a 200
                result.errors += 1
                result.first_error = result.first_error or error
            elif measuring and t1 <= t_end:
                result.latencies_s.append(t1 - t0)
                if len(result.latencies_s) >= max_requests:
                    t_end = t1  # count bound reached: close the window here

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    # stats calls get their own connection: the load pool is always busy
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session,
        aiohttp.ClientSession(timeout=timeout) as control,
    ):
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = await model_stats(control, base, model)
        cpu0, client0, busy0 = cpu_seconds(server.pid), time.process_time(), system_busy_s()
        start = time.perf_counter()
        t_end = start + seconds
        measuring = True
        while time.perf_counter() < t_end:
            await asyncio.sleep(min(0.05, max(0.0, t_end - time.perf_counter())))
        result.seconds = min(time.perf_counter(), t_end) - start
        result.server_cpu_s = cpu_seconds(server.pid) - cpu0
        result.client_cpu_s = time.process_time() - client0
        result.other_cpu_s = max(
            0.0, system_busy_s() - busy0 - result.server_cpu_s - result.client_cpu_s
        )
        await asyncio.gather(*workers)
        after = await model_stats(control, base, model)
    result.executions = after["executions"] - before["executions"]
    result.rows_executed = after["rows"] - before["rows"]
    result.infer_ns = after["infer_ns"] - before["infer_ns"]
    return result


# ---- report ----------------------------------------------------------------------------


def proc_status_kib_meminfo() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


def render(
    args: argparse.Namespace,
    info: dict[str, str],
    ceilings: dict[str, list[CeilingPoint]],
    cases: list[CaseResult],
    server: dict[str, Any],
    command: str,
) -> str:
    out = [f"# HTTP benchmark, started {info['started']}", ""]
    out += ["```", command, "```", "", "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in info.items() if k != "started"]
    out += [
        "",
        "## (a) In-process ONNX Runtime ceiling (no server)",
        "",
        f"Server's backend class, intra-op threads = "
        f"{args.intra_op_threads or cpu_share(1)}, "
        f"{args.ceiling_seconds:g} s per batch size.",
        "",
        "| model | batch | rows/s | ms/call | other CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    best: dict[str, CeilingPoint] = {}
    for name, points in ceilings.items():
        best[name] = max(points, key=lambda p: p.rows_per_s)
        for p in points:
            mark = " **best**" if p is best[name] else ""
            out.append(
                f"| {name} | {p.batch} | {p.rows_per_s:,.0f}{mark} | {p.ms_per_call:.3f} "
                f"| {noise(p.other_cpu_s, p.seconds, args.noise_limit)} |"
            )
    out += [
        "",
        "## (b) Server over HTTP (binary tensor extension, 1 row per request)",
        "",
        f"max_batch_size {args.max_batch_size}; batched variant: max_queue_delay "
        f"{args.queue_delay_us} us, preferred sizes {list(args.preferred) or 'none'}; "
        f"warm-up {args.warmup:g} s, measured {args.seconds:g} s per case. "
        f"Server: start-up to ready {server['ready_s']:.2f} s, RSS at ready "
        f"{server['rss_ready_mib']:.0f} MiB, peak RSS (VmHWM) {server['peak_rss_mib']:.0f} MiB "
        f"({server['models']} model versions loaded). Whole run {server['wall_s']:.0f} s, "
        f"{server['quiet_wait_s']:.0f} s of it waiting for other processes to go idle "
        f"(beyond a 1 s idle check before each case); "
        f"{server['retried']} noisy measurement(s) taken again.",
        "",
        "| model | dyn. batching | conc. | req/s | rows/s | % of ceiling | p50 ms | p99 ms "
        "| mean batch | engine ms/call | server CPU | server CPU µs/req | client CPU "
        "| other CPU | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        ceiling = best[c.model].rows_per_s if c.model in best else float("nan")
        share = 100 * c.rows_per_s / ceiling
        out.append(
            f"| {c.model} | {'yes' if c.batching else 'no'} | {c.concurrency} "
            f"| {c.requests_per_s:,.0f} | {c.rows_per_s:,.0f} | {share:.0f}% "
            f"| {c.latency_ms(50):.2f} | {c.latency_ms(99):.2f} | {c.mean_batch:.1f} "
            f"| {c.infer_ms_per_call:.3f} | {pct(c.server_cpu_s, c.seconds)} "
            f"| {per_request_us(c.server_cpu_s, c)} | {pct(c.client_cpu_s, c.seconds)} "
            f"| {noise(c.other_cpu_s, c.seconds, args.noise_limit)} "
            f"| {c.errors} |"
        )
    floor: list[CaseResult] = server["floor"]
    if floor:
        out += [
            "",
            "### HTTP floor: bare aiohttp, no inference",
            "",
            "The same client and bodies against a minimal aiohttp app that reads each "
            "body and returns a canned response of the real size: what HTTP alone costs "
            "here.",
            "",
            "| body | conc. | req/s | p50 ms | p99 ms | server CPU | server CPU µs/req "
            "| client CPU | other CPU | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in floor:
            size = 4 * int(np.prod(MODELS[c.model].row_shape))
            out.append(
                f"| {c.model} ({size / 1024:,.0f} KiB) | {c.concurrency} "
                f"| {c.requests_per_s:,.0f} | {c.latency_ms(50):.2f} | {c.latency_ms(99):.2f} "
                f"| {pct(c.server_cpu_s, c.seconds)} | {per_request_us(c.server_cpu_s, c)} "
                f"| {pct(c.client_cpu_s, c.seconds)} "
                f"| {noise(c.other_cpu_s, c.seconds, args.noise_limit)} | {c.errors} |"
            )
    errors = [c for c in [*cases, *floor] if c.first_error]
    if errors:
        out += ["", "First error per failing case:", ""]
        out += [
            f"- {c.model} batching={c.batching} c={c.concurrency}: {c.first_error}" for c in errors
        ]
    out += ["", "## Targets", ""]
    out += targets(cases, best)
    return "\n".join(out) + "\n"


def pct(cpu_s: float, seconds: float) -> str:
    """CPU use as % of one core (200% = both cores of a 2-core box)."""
    return f"{100 * cpu_s / seconds:.0f}%" if seconds > 0 else "-"


def per_request_us(cpu_s: float, case: CaseResult) -> str:
    n = len(case.latencies_s)
    return f"{cpu_s / n * 1e6:,.0f}" if n else "-"


def noise(cpu_s: float, seconds: float, limit: float) -> str:
    """Other processes' CPU, flagged when above the noise limit."""
    flag = " (noisy)" if seconds > 0 and cpu_s / seconds > limit else ""
    return pct(cpu_s, seconds) + flag


def find(cases: list[CaseResult], model: str, batching: bool, conc: int) -> CaseResult | None:
    key = (model, batching, conc)
    return next((c for c in cases if (c.model, c.batching, c.concurrency) == key), None)


def targets(cases: list[CaseResult], best: dict[str, CeilingPoint]) -> list[str]:
    lines = []
    top = max((c.concurrency for c in cases), default=0)
    clf = find(cases, "classifier", True, top)
    if clf and "classifier" in best:
        ratio = clf.rows_per_s / best["classifier"].rows_per_s
        lines.append(
            f"- classifier, batched, concurrency {top}: {clf.rows_per_s:,.0f} rows/s = "
            f"**{100 * ratio:.0f}%** of the in-process ceiling "
            f"({best['classifier'].rows_per_s:,.0f} rows/s at batch "
            f"{best['classifier'].batch}); target >= 85%: "
            f"**{'met' if ratio >= 0.85 else 'MISSED'}**"
        )
    on, off = find(cases, "mlp", True, top), find(cases, "mlp", False, top)
    if on and off and off.rows_per_s:
        ratio = on.rows_per_s / off.rows_per_s
        lines.append(
            f"- mlp, concurrency {top}: batched {on.rows_per_s:,.0f} vs unbatched "
            f"{off.rows_per_s:,.0f} rows/s = **{ratio:.2f}x**; target >= 2x: "
            f"**{'met' if ratio >= 2 else 'MISSED'}**"
        )
    return lines or ["- (needs the classifier and mlp at a common top concurrency)"]


# ---- main ----------------------------------------------------------------------------


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="classifier,mlp",
        help="comma-separated subset of: " + ", ".join(MODELS) + " (default: all)",
    )
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=(1, 8, 32),
        help="client concurrencies (default 1,8,32)",
    )
    p.add_argument(
        "--batch-sizes",
        type=int_list,
        default=(1, 2, 4, 8, 16, 32),
        help="ceiling sweep (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="measured seconds per server case (default %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="warm-up seconds per server case (default %(default)s)",
    )
    p.add_argument(
        "--ceiling-seconds",
        type=float,
        default=1.5,
        help="seconds per batch size in the ceiling sweep (default %(default)s)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=200_000,
        help="request-count bound per measured case (default %(default)s)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="max_batch_size of both variants (default %(default)s)",
    )
    p.add_argument(
        "--queue-delay-us",
        type=int,
        default=1000,
        help="max_queue_delay_microseconds of the batched variant (default %(default)s)",
    )
    p.add_argument(
        "--preferred",
        type=int_list,
        default=(),
        help="preferred_batch_size of the batched variant (default none)",
    )
    p.add_argument(
        "--noise-limit",
        type=float,
        default=0.25,
        metavar="CORES",
        help="other processes may use this many cores on average during a "
        "measurement before it counts as noisy (default 0.25)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=4,
        help="noisy measurements the whole run may take again (default 4)",
    )
    p.add_argument(
        "--quiet-budget",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="total time the run may spend waiting for an idle machine "
        "(default 30; 0 = never wait)",
    )
    p.add_argument(
        "--intra-op-threads",
        type=int,
        metavar="N",
        help="set the models' intra_op_thread_count parameter (server and ceiling); "
        "default: the server's own choice, all usable cores for one instance",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the HTTP floor (bare aiohttp, no inference) cases",
    )
    p.add_argument(
        "--out", type=Path, help="report file (default benchmarks/results/<date>-http.md)"
    )
    p.add_argument("--no-save", action="store_true", help="print the report only")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        p.error(f"--models: unknown {unknown}; expected some of {list(MODELS)}")
    args.specs = [MODELS[m] for m in names]
    return args


async def measure(
    server: ServerProcess,
    spec: ModelSpec,
    batching: bool,
    conc: int,
    args: argparse.Namespace,
    guard: NoiseGuard,
    label: str,
) -> CaseResult:
    """One case, taken again (within the guard's bounds) when other processes disturbed it."""
    errors = 0
    for attempt in range(args.retries + 1):
        await guard.settle()
        case = await run_case(
            server, spec, batching, conc, args.warmup, args.seconds, args.max_requests
        )
        errors += case.errors  # a retry must not hide failed requests
        log(
            f"{label:<8} {spec.name:<10} batching={'yes' if batching else 'no ':<3} c={conc:<3}"
            f" {case.requests_per_s:6.0f} req/s  p50 {case.latency_ms(50):7.2f} ms  "
            f"p99 {case.latency_ms(99):7.2f} ms  batch {case.mean_batch:4.1f}  "
            f"errors {case.errors}  other CPU {pct(case.other_cpu_s, case.seconds)}"
            + (f"  (attempt {attempt + 1})" if attempt else "")
        )
        if not guard.retry(case.other_cpu_s, case.seconds):
            break
    case.errors = errors
    return case


async def bench_server(
    args: argparse.Namespace, repo: Path, workdir: Path, guard: NoiseGuard
) -> tuple[list[CaseResult], dict[str, Any]]:
    port = free_port()
    server = ServerProcess(appliance_command(repo, port), port, workdir / "server.log")
    log(f"starting server pid {server.pid}: {shlex.join(server.command)}")
    cases: list[CaseResult] = []
    try:
        await server.wait_ready()
        log(f"server ready in {server.ready_s:.2f}s, RSS {server.rss_ready_kib / 1024:.0f} MiB")
        for spec in args.specs:
            for batching in (True, False):
                for conc in args.concurrency:
                    cases.append(await measure(server, spec, batching, conc, args, guard, "server"))
        peak_kib = proc_status_kib(server.pid, "VmHWM")
    finally:
        rc = server.stop()
        log(f"server stopped (exit status {rc})")
        if rc not in (0, None):
            log(f"server log tail:\n{server.log_tail()}")
    return cases, {
        "ready_s": server.ready_s,
        "rss_ready_mib": server.rss_ready_kib / 1024,
        "peak_rss_mib": peak_kib / 1024,
        "models": 2 * len(args.specs),
    }


async def bench_floor(
    args: argparse.Namespace, workdir: Path, guard: NoiseGuard
) -> list[CaseResult]:
    """The same load against a bare aiohttp app, at the top concurrency."""
    port = free_port()
    server = ServerProcess(bare_command(args.specs, port), port, workdir / "floor.log")
    log(f"starting the HTTP floor server pid {server.pid}")
    try:
        await server.wait_ready()
        return [
            await measure(server, spec, False, max(args.concurrency), args, guard, "floor")
            for spec in args.specs
        ]
    finally:
        server.stop()


async def run_all(
    args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, list[CeilingPoint]], list[CaseResult], dict[str, Any]]:
    guard = NoiseGuard(args.noise_limit, args.quiet_budget, args.retries)
    repo = tmp / "models"
    write_repository(repo, args.specs, args)
    ceilings = {}
    for spec in args.specs:
        path = repo / f"{spec.name}_nobatch" / "1" / "model.onnx"
        ceilings[spec.name] = await measure_ceiling(path, spec, args, guard)
    cases, server = await bench_server(args, repo, tmp, guard)
    server["floor"] = [] if args.no_floor else await bench_floor(args, tmp, guard)
    server["quiet_wait_s"] = guard.waited_s
    server["retried"] = guard.retried
    return ceilings, cases, server


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwind through the finally blocks that stop servers


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    except RuntimeError as exc:  # the server failed to start or load: say why, no traceback
        log(f"error: {exc}")
        return 2
    finally:
        for server in list(ServerProcess.LIVE):
            server.stop()


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    info = describe("onnxruntime", "aiohttp", "uvloop", "numpy")
    info["started"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    # the load average lags by minutes; the 'other CPU' columns are the real noise gauge
    log(
        f"machine: {info['CPU']}, {info['cores (usable)']} cores, "
        f"load average {info['load average before run (1/5/15 min)']}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_http_") as tmp:
        ceilings, cases, server = asyncio.run(run_all(args, Path(tmp)))
    server["wall_s"] = time.perf_counter() - started
    report = render(args, info, ceilings, cases, server, command)
    print(report)
    if not args.no_save:
        out = args.out or (
            REPO_ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-http.md"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        log(f"wrote {out}")
    return 1 if any(c.errors for c in [*cases, *server["floor"]]) else 0


if __name__ == "__main__":
    sys.exit(main())
