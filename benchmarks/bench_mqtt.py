"""MQTT round trips through mosquitto against the same models over HTTP.

A benchmark, not a test. It starts a real mosquitto (Debian's package) on a free
loopback port and ``python -m appliance serve`` with the MQTT bridge on, then, for
each model and client concurrency (default 1, 8, 32), measures requests/s and the
p50/p99 round trip:

- **mqtt**: a paho-mqtt v5 client publishes binary-extension requests (QoS 1,
  ``Inference-Header-Content-Length`` user property, a response topic and
  correlation data) and keeps ``concurrency`` requests outstanding: each reply
  sends the next request. The round trip is publish -> broker -> appliance ->
  broker -> reply callback.
- **http**: the same request bodies POSTed by aiohttp with ``concurrency`` workers,
  as ``benchmarks/bench_http.py`` does.

Models: ``simple`` (the demo add/sub, 2 x INT32 [1,16], per-request overhead
dominates) and ``frame`` (``frame_mean`` on a 640x480 RGB UINT8 frame, 900 KiB per
request). Each case: a warm-up, then a measured window; a request counts if it
completes inside the window, and the window also closes after ``--max-requests``.
Every reply is checked (no error, the expected size). CPU time of the server and of
the broker is read from /proc around each window.

``--baseline DIR`` serves a second source tree (another checkout, e.g. a ``git
worktree`` of the commit before a change) next to this one, on its own topic prefix
and HTTP port, and ``--repeats N`` runs every case N times alternating the trees, so
both sides see the same machine noise; the report adds each side's median server CPU
per request and the MQTT/HTTP ratio.

Results are printed as markdown and written to ``benchmarks/results/<date>-mqtt.md``.
Everything is stopped by PID at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the broker helper the MQTT tests use

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)
from mosquitto import Broker, find_mosquitto, free_port  # noqa: E402
from probes import cpu_seconds  # noqa: E402

from devtools import modelgen  # noqa: E402

HEADER = "Inference-Header-Content-Length"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PREFIX = "bench"
DEVICE = "bench-device"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    model: str
    body: bytes  # binary-extension request: JSON header + raw tensors
    header_length: int
    reply_bytes: int  # expected size of the binary part of the reply


def binary_request(tensors: list[tuple[str, np.ndarray, str]]) -> tuple[bytes, int]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(arr.shape),
                    "parameters": {"binary_data_size": arr.nbytes},
                }
                for name, arr, datatype in tensors
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    return header + b"".join(arr.tobytes() for _, arr, _ in tensors), len(header)


def workloads() -> dict[str, Workload]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    body, length = binary_request([("INPUT0", a, "INT32"), ("INPUT1", a, "INT32")])
    out = {"simple": Workload("simple", body, length, 2 * 64)}
    frame = np.random.default_rng(0).integers(0, 255, (1, 480, 640, 3), dtype=np.uint8)
    body, length = binary_request([("frame", frame, "UINT8")])
    out["frame"] = Workload("frame_mean", body, length, 3 * 4)
    return out


# ---- results ------------------------------------------------------------------------------


@dataclass
class Case:
    transport: str
    workload: str
    concurrency: int
    side: str = ""
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, completed in the window
    errors: int = 0
    first_error: str = ""
    server_cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    load: float = 0.0  # the 1-minute load average after the case

    def per_s(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3) if self.latencies else float("nan")

    def cpu_ms(self, total: float) -> float:
        return total / len(self.latencies) * 1e3 if self.latencies else float("nan")


class Window:
    """Warm-up, then the measured window, closed early after ``max_requests``."""

    def __init__(self, warmup_s: float, seconds: float, max_requests: int) -> None:
        now = time.perf_counter()
        self.start = now + warmup_s
        self.end = self.start + seconds
        self.max_requests = max_requests
        self.closed_at = 0.0

    def record(self, case: Case, started: float, done: float) -> bool:
        """Record one completion; False once no more requests should be sent."""
        if self.start <= started and done <= self.end and not self.closed_at:
            case.latencies.append(done - started)
            if len(case.latencies) >= self.max_requests:
                self.closed_at = done
        return done < self.end and not self.closed_at

    @property
    def measured_s(self) -> float:
        return (self.closed_at or self.end) - self.start


# ---- the MQTT load generator ----------------------------------------------------------------


class MqttLoad:
    """One paho client; each reply (on paho's network thread) sends the next request."""

    def __init__(self, port: int) -> None:
        self.reply_topic = f"{PREFIX}/replies/{os.getpid()}"
        self._lock = threading.Lock()
        self._pending: dict[bytes, float] = {}
        self._ids = itertools.count()
        self._sending = False
        self._prefix = ""
        self._work: Workload | None = None
        self._case: Case | None = None
        self._window: Window | None = None
        self._idle = threading.Event()
        c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"bench-{os.getpid()}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        c.on_message = self._on_reply
        c.on_socket_open = lambda cl, u, sock: sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        c.connect("127.0.0.1", port, keepalive=30)
        c.subscribe(self.reply_topic, qos=1)
        c.loop_start()
        self.client = c

    def _send(self) -> None:
        assert self._work is not None and self._prefix
        corr = b"%d" % next(self._ids)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = corr
        props.UserProperty = (HEADER, str(self._work.header_length))
        with self._lock:
            self._pending[corr] = time.perf_counter()
        self.client.publish(
            f"{self._prefix}/{DEVICE}/infer/{self._work.model}",
            self._work.body,
            qos=1,
            properties=props,
        )

    def _on_reply(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        done = time.perf_counter()
        props = message.properties
        corr = getattr(props, "CorrelationData", b"")
        with self._lock:
            started = self._pending.pop(corr, None)
            left = len(self._pending)
        if started is None or self._case is None or self._window is None or self._work is None:
            return
        user = dict(getattr(props, "UserProperty", None) or [])
        header = int(user.get(HEADER, -1))
        if "error-code" in user or len(message.payload) - header != self._work.reply_bytes:
            self._case.errors += 1
            self._case.first_error = self._case.first_error or message.payload[:200].decode(
                errors="replace"
            )
        elif not self._window.record(self._case, started, done):
            self._sending = False
        if self._sending:
            self._send()
        elif left == 0:
            self._idle.set()

    def run(self, case: Case, work: Workload, window: Window, prefix: str = PREFIX) -> None:
        self._work, self._case, self._window, self._prefix = work, case, window, prefix
        self._idle.clear()
        self._sending = True
        for _ in range(case.concurrency):
            self._send()
        time.sleep(max(0.0, window.end - time.perf_counter()))
        self._sending = False
        if not self._idle.wait(30):
            case.errors += len(self._pending)
            case.first_error = case.first_error or f"{len(self._pending)} replies never came"
            self._pending.clear()
        case.seconds = window.measured_s

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ---- the HTTP load generator ----------------------------------------------------------------


async def http_case(url: str, case: Case, work: Workload, window: Window) -> None:
    headers = {HEADER: str(work.header_length), "Content-Type": "application/octet-stream"}
    connector = aiohttp.TCPConnector(limit=case.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            going = True
            while going:
                started = time.perf_counter()
                async with session.post(
                    f"{url}/v2/models/{work.model}/infer", data=work.body, headers=headers
                ) as r:
                    body = await r.read()
                done = time.perf_counter()
                header = int(r.headers.get(HEADER, -1))
                if r.status != 200 or len(body) - header != work.reply_bytes:
                    case.errors += 1
                    case.first_error = case.first_error or body[:200].decode(errors="replace")
                    going = done < window.end
                else:
                    going = window.record(case, started, done)

        await asyncio.gather(*(worker() for _ in range(case.concurrency)))
    case.seconds = window.measured_s


# ---- the run ------------------------------------------------------------------------------


def start_appliance(
    repo: Path,
    workdir: Path,
    broker_port: int,
    http_port: int,
    tree: Path = REPO_ROOT,
    prefix: str = PREFIX,
) -> subprocess.Popen[bytes]:
    config = workdir / f"appliance-{prefix}.yaml"
    config.write_text(
        f"mqtt:\n  host: 127.0.0.1\n  port: {broker_port}\n  device_id: {DEVICE}\n"
        f"  client_id: {DEVICE}-{prefix}\n  topic_prefix: {prefix}\n  max_pending: 256\n"
    )
    command = [
        sys.executable, "-m", "appliance", "serve", "--config", str(config),
        "--model-repository", str(repo), "--http-port", str(http_port),
        "--grpc-port", "-1", "--metrics-port", "-1", "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"appliance-{prefix}.log", "wb"),
    )


def wait_online(port: int, timeout_s: float = 120.0, prefix: str = PREFIX) -> None:
    """The bridge's retained status turns 'online' once it has subscribed."""
    online = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
    c.on_message = lambda cl, u, m: m.payload == b"online" and online.set()
    c.connect("127.0.0.1", port)
    c.subscribe(f"{prefix}/{DEVICE}/status", qos=1)
    c.loop_start()
    try:
        if not online.wait(timeout_s):
            raise RuntimeError("the appliance never came online over MQTT")
    finally:
        c.disconnect()
        c.loop_stop()


def machine() -> dict[str, str]:
    broker_version = subprocess.run(
        [find_mosquitto() or "mosquitto", "-h"], capture_output=True, text=True
    ).stdout.splitlines()[:1]
    info = describe("paho-mqtt")
    info["broker"] = broker_version[0] if broker_version else "mosquitto"
    return info


def render(cases: list[Case], info: dict[str, str], command: str, started: str) -> str:
    out = [f"# MQTT benchmark, {started}", "", "```", command, "```", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in info.items()]
    sided = any(c.side for c in cases)
    out += [
        "",
        "Client, broker and server share the machine. CPU ms/req: CPU time of the "
        "appliance process (and of mosquitto) per completed request; load: the 1-minute "
        "load average after the case.",
        "",
        ("| tree " if sided else "")
        + "| model | transport | conc | req/s | p50 ms | p99 ms | server CPU ms/req | "
        "broker CPU ms/req | errors | load |",
        ("|---" if sided else "") + "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        broker = f"{c.cpu_ms(c.broker_cpu_s):.3f}" if c.transport == "mqtt" else "-"
        out.append(
            (f"| {c.side} " if sided else "")
            + f"| {c.workload} | {c.transport} | {c.concurrency} | {c.per_s():.0f} | "
            f"{c.ms(50):.2f} | {c.ms(99):.2f} | {c.cpu_ms(c.server_cpu_s):.3f} | {broker} | "
            f"{c.errors} | {c.load:.2f} |"
        )
    if sided:
        out += ["", "Medians over the repeats (server CPU ms/req; MQTT / HTTP):", ""]
        out += [
            "| tree | model | conc | mqtt | http | mqtt / http |",
            "|---|---|---:|---:|---:|---:|",
        ]
        keys = dict.fromkeys((c.side, c.workload, c.concurrency) for c in cases)
        for side, workload, level in keys:
            med = {}
            for transport in ("mqtt", "http"):
                got = [
                    c.cpu_ms(c.server_cpu_s)
                    for c in cases
                    if (c.side, c.workload, c.concurrency, c.transport)
                    == (side, workload, level, transport)
                ]
                med[transport] = float(np.median(got)) if got else float("nan")
            out.append(
                f"| {side} | {workload} | {level} | {med['mqtt']:.3f} | {med['http']:.3f} | "
                f"{med['mqtt'] / med['http']:.2f} |"
            )
    errors = [c for c in cases if c.first_error]
    out += [""] + [
        f"- {c.transport} {c.workload} c={c.concurrency}: {c.first_error}" for c in errors
    ]
    return "\n".join(out) + "\n"


def tree_name(tree: Path) -> str:
    """The tree's commit, ``+`` when it has changes not committed."""
    git = ["git", "-C", str(tree)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return (rev.stdout.strip() or tree.name) + ("+" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--workloads", default="simple,frame", help="simple,frame")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per case")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--baseline", type=Path, help="another source tree, served alongside")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (alternated)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    binary = find_mosquitto()
    if binary is None:
        log("mosquitto not found: apt-get install mosquitto")
        return 2
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    command = shlex.join(
        ["python3", "benchmarks/bench_mqtt.py", *(argv if argv is not None else sys.argv[1:])]
    )
    info = machine()
    chosen = [workloads()[w] for w in args.workloads.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    trees = [REPO_ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-") as tmp:
        workdir = Path(tmp)
        repo = workdir / "models"
        modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
        modelgen.write_model(repo, "frame_mean", modelgen.frame_mean())
        (workdir / "broker").mkdir()
        broker = Broker(binary, workdir / "broker")
        broker.start()
        # one appliance per tree: (name, prefix, http port, process)
        sides = []
        for i, tree in enumerate(trees):
            prefix, port = f"{PREFIX}{i}" if args.baseline else PREFIX, free_port()
            proc = start_appliance(repo, workdir, broker.port, port, tree, prefix)
            sides.append((tree_name(tree) if args.baseline else "", prefix, port, proc))
        load: MqttLoad | None = None
        try:
            log(f"mosquitto on {broker.port}, appliance pids {[s[3].pid for s in sides]}")
            for _, prefix, _, _ in sides:
                wait_online(broker.port, prefix=prefix)
            load = MqttLoad(broker.port)
            for work in chosen:
                for level in levels:
                    for _ in range(args.repeats):
                        for name, prefix, http_port, server in sides:
                            for transport in ("mqtt", "http"):
                                case = Case(transport, work.model, level, name)
                                run_case(load, case, work, args, server, broker, prefix, http_port)
                                cases.append(case)
        finally:
            if load is not None:
                load.close()
            for *_, server in sides:
                server.terminate()
            for *_, server in sides:
                try:
                    server.wait(40)
                except subprocess.TimeoutExpired:
                    server.kill()
            broker.stop()
    report = render(cases, info, command, started)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{started[:10]}-mqtt.md"
    path.write_text(report)
    log(f"wrote {path}")
    return 1 if any(c.errors for c in cases) else 0


def run_case(
    load: MqttLoad,
    case: Case,
    work: Workload,
    args: argparse.Namespace,
    server: subprocess.Popen[bytes],
    broker: Broker,
    prefix: str,
    http_port: int,
) -> None:
    window = Window(args.warmup, args.seconds, args.max_requests)
    cpu0 = (cpu_seconds(server.pid), cpu_seconds(broker.process.pid))  # type: ignore[union-attr]
    if case.transport == "mqtt":
        load.run(case, work, window, prefix)
    else:
        asyncio.run(http_case(f"http://127.0.0.1:{http_port}", case, work, window))
    cpu1 = (cpu_seconds(server.pid), cpu_seconds(broker.process.pid))  # type: ignore[union-attr]
    # CPU over warm-up + window, scaled to the window's share
    share = case.seconds / (case.seconds + args.warmup)
    case.server_cpu_s = (cpu1[0] - cpu0[0]) * share
    case.broker_cpu_s = (cpu1[1] - cpu0[1]) * share
    case.load = os.getloadavg()[0]
    log(
        f"{case.side} {work.model} {case.transport} c={case.concurrency}: "
        f"{case.per_s():.0f} req/s, p50 {case.ms(50):.2f} ms, p99 {case.ms(99):.2f} ms, "
        f"{case.server_cpu_s * 1e3 / max(1, len(case.latencies)):.3f} ms CPU/req, "
        f"{case.errors} errors"
    )


if __name__ == "__main__":
    sys.exit(main())
