"""Every transport with ``appliance perf``, and ``perf_analyzer`` as a cross-check.

A benchmark, not a test. It writes a model repository (the demo ``simple``, the
``mlp`` and the ``classifier`` of :mod:`devtools.modelgen`, batched as the demo
configs are), starts ``python -m appliance serve`` with system shared memory on,
and, when Debian's ``mosquitto`` is installed, a broker and the MQTT bridge. Then
for each model it runs ``python -m appliance perf`` as a separate process at the
given concurrency over each transport:

- **ceiling**: ``appliance perf --ceiling`` (the load generator against a trivial
  server that does no work): the most the client can measure here;
- **http**, **grpc**, **shm**, **mqtt**: against the server (``json``: HTTP with the
  tensors as JSON ``data`` lists, on request with ``--transports``);
- **inprocess**: the same repository loaded inside the perf process (no sockets).

Server CPU per request is read from ``/proc/<pid>/stat`` and the model's
statistics around each run (all requests of the run, warm-up included, on both
sides of the ratio). With ``--perf-analyzer PATH`` the HTTP and gRPC figures are
measured again, interleaved ``--repeats`` times with NVIDIA's perf_analyzer at the
same concurrency, and the medians compared. Results: markdown on stdout and in
``benchmarks/results/<date>-perf.md``. Everything started is stopped by PID.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from machine import describe
from probes import cpu_seconds, free_port, successes

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from devtools import modelgen  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
MLP_CONFIG = """backend: onnxruntime
max_batch_size: 32
input: [{name: input, data_type: TYPE_FP32, dims: [256]}]
output: [{name: output, data_type: TYPE_FP32, dims: [16]}]
dynamic_batching: {max_queue_delay_microseconds: 1000}
"""


def perf(args: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "appliance", "perf", *args, "--quiet", "--json", str(out)]
    subprocess.run(cmd, env=ENV, cwd=REPO_ROOT, check=False, timeout=600)
    doc: dict[str, Any] = json.loads(out.read_text())["points"][0]
    return doc


def perf_analyzer(pa: str, model: str, url: str, proto: str, c: int, seconds: float) -> float:
    window = str(int(seconds * 1000))
    cmd = [pa, "-m", model, "-u", url, "-i", proto, "--concurrency-range", str(c),
           "--measurement-interval", window, "-s", "100", "--max-trials", "3"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    found = re.findall(r"Throughput: ([\d.]+) infer/sec", text)
    return float(found[-1]) if found else 0.0


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=ENV, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # fmt: skip


def wait_ready(http: str, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not become ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="simple,mlp,classifier")
    ap.add_argument("--transports", default="ceiling,http,grpc,shm,mqtt,inprocess")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--perf-analyzer", help="path of perf_analyzer for the cross-check")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-perf-"))
    repo = work / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    modelgen.write_model(repo, "mlp", modelgen.mlp(), MLP_CONFIG)
    modelgen.write_model(repo, "classifier", modelgen.classifier(), modelgen.CLASSIFIER_CONFIG)
    http, grpc, device = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", "bench"
    procs: list[subprocess.Popen[bytes]] = []
    broker = ""
    config = "shared_memory: system\n"
    mosquitto = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if mosquitto and "mqtt" in a.transports:
        broker = f"127.0.0.1:{free_port()}"
        conf = work / "mosquitto.conf"
        # set_tcp_nodelay: request/response traffic must not wait for Nagle on the broker
        conf.write_text(
            f"listener {broker.split(':')[1]} 127.0.0.1\nallow_anonymous true\n"
            "set_tcp_nodelay true\nmax_queued_messages 10000\n"
            + ("user root\n" if os.geteuid() == 0 else "")
        )
        procs.append(start([mosquitto, "-c", str(conf)], work / "mosquitto.log"))
        config += f"mqtt:\n  host: 127.0.0.1\n  port: {broker.split(':')[1]}\n"
        config += f"  device_id: {device}\n  max_pending: 256\n"
    (work / "appliance.yaml").write_text(config)
    server = start([sys.executable, "-m", "appliance", "serve", "--config",
                    str(work / "appliance.yaml"), "--model-repository", str(repo),
                    "--http-port", http.split(":")[1], "--grpc-port", grpc.split(":")[1],
                    "--metrics-port", "-1", "--log-level", "warning"],
                   work / "server.log")  # fmt: skip
    procs.append(server)
    rows: list[str] = []
    cross: list[str] = []
    try:
        wait_ready(http, server)
        time.sleep(1.0)  # the MQTT bridge connects in the background
        base = ["--concurrency", str(a.concurrency), "--warmup", str(a.warmup),
                "--duration", str(a.seconds)]  # fmt: skip
        for model in a.models.split(","):
            for t in a.transports.split(","):
                if t == "mqtt" and not broker:
                    continue
                args = ["-m", model, "-u", http, "--grpc-url", grpc, *base]
                if t == "ceiling":
                    args = ["--ceiling", *base]
                elif t == "mqtt":
                    args += ["-i", "mqtt", "--mqtt-broker", broker, "--mqtt-device", device]
                elif t == "json":  # HTTP with the tensors as JSON lists, as curl sends
                    args += ["-i", "http", "--json-data"]
                elif t == "inprocess":
                    args += ["-i", "inprocess", "--model-repository", str(repo)]
                else:
                    args += ["-i", t]
                n0, c0 = successes(http, model), cpu_seconds(server.pid)
                p = perf(args, work / "p.json")
                dn, dc = successes(http, model) - n0, cpu_seconds(server.pid) - c0
                server_us = f"{dc * 1e6 / dn:.0f}" if dn > 0 and t != "inprocess" else "-"
                rows.append(
                    f"| {model} | {t} | {p['throughput_infer_s']:.0f} | {p['p50_ms']:.2f} "
                    f"| {p['p99_ms']:.2f} | {server_us} | {p['client_cpu_us_per_req']:.0f} "
                    f"| {p['errors']} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)
            if a.perf_analyzer:
                for proto, url in (("http", http), ("grpc", grpc)):
                    ours, theirs = [], []
                    for _ in range(a.repeats):
                        theirs.append(perf_analyzer(a.perf_analyzer, model, url, proto,
                                                    a.concurrency, a.seconds))  # fmt: skip
                        args = ["-m", model, "-u", http, "--grpc-url", grpc, "-i", proto, *base]
                        ours.append(perf(args, work / "p.json")["throughput_infer_s"])
                    # 0: perf_analyzer gave no figure (no stable window on a busy machine)
                    got = [x for x in theirs if x > 0] or [0.0]
                    mo, mt = statistics.median(ours), statistics.median(got)
                    cross.append(
                        f"| {model} | {proto} | {mt:.0f} | {mo:.0f} | {mo / mt if mt else 0:.2f} "
                        f"| {', '.join(f'{x:.0f}' for x in theirs)} "
                        f"| {', '.join(f'{x:.0f}' for x in ours)} |"
                    )
                    print(cross[-1], file=sys.stderr, flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    info = describe("onnxruntime", "grpcio", "aiohttp", "uvloop", "paho-mqtt")
    out = [f"# appliance perf, every transport ({datetime.date.today()})", "",
           "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items()), "",
           f"Command: `python benchmarks/bench_perf.py {' '.join(sys.argv[1:])}`", "",
           f"Concurrency {a.concurrency}, batch 1, {a.seconds:g} s per point after "
           f"{a.warmup:g} s warm-up.", "",
           "| model | transport | infer/s | p50 ms | p99 ms | server CPU us/req "
           "| client CPU us/req | errors |", "|---|---|---|---|---|---|---|---|",
           *rows]  # fmt: skip
    if cross:
        out += ["", "perf_analyzer vs appliance perf (medians of interleaved runs):", "",
                "| model | protocol | perf_analyzer | appliance perf | ratio | PA runs | ours |",
                "|---|---|---|---|---|---|---|", *cross]  # fmt: skip
    text = "\n".join(out) + "\n"
    print(text)
    if not a.no_save:
        path = REPO_ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-perf.md"
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
