"""What tests/test_no_egress.py runs inside the sealed network (tests/sealed_network.py).

``python3 tests/egress_scenario.py OUT REPO`` first checks its instruments (a traced
canary looks up ``canary.invalid`` and connects to 192.0.2.1: the recorder and the trace
must both see it), starts a mosquitto broker on loopback, then ``appliance serve`` on
REPO under strace, with HTTP, gRPC and metrics on loopback, the MQTT bridge on that
broker (the one endpoint its config names: the trace must show it), an empty HOME and
none of the variables that tell ONNX Runtime it runs in CI. Once the server is ready it
serves a bounded number of requests to every model over HTTP and gRPC (and ``simple``
over MQTT), keeps a light stream of requests going until ``WINDOW_S`` seconds after
ready, stops the server with SIGTERM and writes ``OUT/report.json``.

Why ``WINDOW_S``: the uploader of ONNX Runtime 1.29 to 1.32 first looks its collector
up about 9 s after the library is imported (then 14 s, 23 s, 44 s...), and the import
happens before the server is ready, so 12 s after ready covers the first lookup with a
margin. The test does not rely on that timing alone: that uploader writes its device id
and event store into HOME as soon as it starts, so an empty HOME at the end says it
never started, whenever it would have sent.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import sealed_network
from mosquitto import Broker, Client, find_mosquitto

# observed after ready (see the module docstring); EGRESS_WINDOW_S lengthens it for a
# run by hand (docs/security.md quotes one of 300 s)
WINDOW_S = float(os.environ.get("EGRESS_WINDOW_S", "12"))
REPLIES = "appliance/sealed/replies"
ROUNDS = 20  # requests per model and protocol before the window's light stream

CANARY = """\
import socket
try:
    socket.getaddrinfo("canary.invalid", 80)
except OSError:
    pass
s = socket.socket()
try:
    s.connect(("192.0.2.1", 9))
except OSError:
    pass
"""


def _server_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in sealed_network.CI_VARIABLES}
    env["HOME"] = str(home)
    # what the appliance must set itself: a device's environment does not carry them
    for name in ("ORT_DISABLE_TELEMETRY", "ORT_TELEMETRY_DISABLED"):
        env.pop(name, None)
    return env


def _config(out: Path, repo: Path, broker: int) -> Path:
    path = out / "appliance.yaml"
    path.write_text(
        f"model_repository: {repo}\nhost: 127.0.0.1\n"
        "http_port: 0\ngrpc_port: 0\nmetrics_port: 0\n"
        f"mqtt: {{host: 127.0.0.1, port: {broker}, device_id: sealed}}\n"
    )
    return path


def _start(config: Path, log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str]]:
    command = [sys.executable, "-m", "appliance", "serve", "--config", str(config)]
    proc = subprocess.Popen(
        sealed_network.traced(command, log), stderr=subprocess.PIPE, text=True, env=env
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _ports(lines: list[str], proc: subprocess.Popen[str]) -> tuple[int, int, int]:
    pattern = re.compile(r"http://127\.0\.0\.1:(\d+) .*grpc 127\.0\.0\.1:(\d+).*:(\d+)/metrics")
    for _ in range(1200):  # bounded: 120 s (models load under strace on a busy machine)
        for line in list(lines):
            m = pattern.search(line)
            if m:
                return int(m.group(1)), int(m.group(2)), int(m.group(3))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def _wait_ready(http: int) -> None:
    for _ in range(1200):  # bounded: 120 s
        try:
            url = f"http://127.0.0.1:{http}/v2/health/ready"
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server never became ready")


def _wait_online(mqtt: Client) -> None:
    """The bridge publishes a retained 'online' once it has subscribed."""
    status = "appliance/sealed/status"
    mqtt.subscribe(status)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        reply = mqtt.collect(1, timeout=max(0.1, end - time.monotonic()))[0]
        if reply.topic == status and reply.payload == b"online":
            return
    raise RuntimeError("the MQTT bridge never came online")


def _png() -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


class _Traffic:
    """Requests to every model over HTTP and gRPC with the real tritonclient."""

    def __init__(self, http: int, grpc: int, metrics: int, mqtt: Client) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.h, self.g, self.metrics = httpclient, grpcclient, metrics
        self.http = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        self.grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        self.a = np.arange(16, dtype=np.int32).reshape(1, 16)
        self.image = _png()
        self.mqtt = mqtt
        self.served: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.served[what] = self.served.get(what, 0) + 1

    def simple(self, model: str, grpc: bool) -> None:
        lib, client = (self.g, self.grpc) if grpc else (self.h, self.http)
        inputs = [lib.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
        inputs[0].set_data_from_numpy(self.a)
        inputs[1].set_data_from_numpy(np.ones_like(self.a))
        result = client.infer(model, inputs)
        if not np.array_equal(result.as_numpy("OUTPUT0"), self.a + 1):
            raise AssertionError(f"{model}: wrong answer")
        self._count(f"{model} over {'gRPC' if grpc else 'HTTP'}")

    def camera(self, grpc: bool) -> None:
        lib, client = (self.g, self.grpc) if grpc else (self.h, self.http)
        image = lib.InferInput("IMAGE", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[self.image]], dtype=np.object_))
        labels = client.infer("image_classifier", [image]).as_numpy("LABELS")
        if labels is None or labels.shape != (1, 5):
            raise AssertionError("image_classifier: no labels")
        self._count(f"image_classifier over {'gRPC' if grpc else 'HTTP'}")

    def over_mqtt(self) -> None:
        doc = {
            "inputs": [
                {"name": f"INPUT{i}", "datatype": "INT32", "shape": [1, 16], "data": data}
                for i, data in ((0, self.a.ravel().tolist()), (1, [1] * 16))
            ]
        }
        self.mqtt.publish(
            "appliance/sealed/infer/simple", orjson.dumps(doc), response_topic=REPLIES
        )
        reply = orjson.loads(self.mqtt.collect(1, topic=REPLIES)[0].payload)
        if reply["outputs"][0]["data"] != (self.a + 1).ravel().tolist():
            raise AssertionError(f"simple over MQTT: wrong answer {reply}")
        self._count("simple over MQTT")

    def scrape(self) -> None:
        url = f"http://127.0.0.1:{self.metrics}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        self._count("metrics")

    def round(self) -> None:
        for grpc in (False, True):
            for model in ("simple", "simple_openvino", "simple_process"):
                self.simple(model, grpc)
            self.camera(grpc)
        self.over_mqtt()
        self.scrape()


def _server_pid(strace: subprocess.Popen[str]) -> int | None:
    for _ in range(50):
        children = Path(f"/proc/{strace.pid}/task/{strace.pid}/children")
        try:
            found = children.read_text().split()
        except OSError:
            return None
        if found:
            return int(found[0])
        time.sleep(0.1)
    return None


def main(out: Path, repo: Path, report: dict[str, Any]) -> None:
    canary = out / "canary.log"
    subprocess.run(sealed_network.traced([sys.executable, "-c", CANARY], canary), check=True)
    report["canary_addresses"] = sealed_network.outside_addresses(canary)
    report["canary_queries"] = [q["name"] for q in sealed_network.queries(out)]
    (out / "dns.jsonl").write_text("")  # the server's queries only from here on

    binary = find_mosquitto()
    if binary is None:
        raise RuntimeError("mosquitto is not installed")
    (out / "broker").mkdir()
    broker = Broker(binary, out / "broker")
    broker.start()
    report["broker"] = f"127.0.0.1:{broker.port}"
    home = out / "home"
    home.mkdir()
    config = _config(out, repo, broker.port)
    proc, lines = _start(config, out / "server.strace", _server_env(home))
    mqtt = Client(broker.port)
    try:
        http, grpc, metrics = _ports(lines, proc)
        _wait_ready(http)
        ready = time.monotonic()
        _wait_online(mqtt)
        mqtt.subscribe(REPLIES)
        traffic = _Traffic(http, grpc, metrics, mqtt)
        for _ in range(ROUNDS):
            traffic.round()
        while time.monotonic() - ready < WINDOW_S:  # a light stream until the window closes
            traffic.simple("simple", grpc=False)
            time.sleep(0.2)
        report["served"] = traffic.served
        report["observed_after_ready_s"] = round(time.monotonic() - ready, 1)
    finally:
        pid = _server_pid(proc)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        try:
            report["exit"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            report["exit"] = proc.wait()
        report["log_tail"] = "".join(lines[-30:])
        mqtt.close()
        broker.stop()
        report["home"] = sorted(str(p.relative_to(home)) for p in home.rglob("*"))


if __name__ == "__main__":
    out_dir, found = Path(sys.argv[1]), {}
    try:
        main(out_dir, Path(sys.argv[2]), found)
    except Exception as exc:  # the test shows it with whatever was recorded before
        found["error"] = f"{type(exc).__name__}: {exc}"
    (out_dir / "report.json").write_text(json.dumps(found, indent=1))
