"""``appliance serve`` imports only what its configured models and endpoints need.

Each case runs the real ``appliance serve`` command in a fresh interpreter. A logging
handler, installed before the command starts, waits for the server's "ready in" line,
asks for readiness and sends one real inference over HTTP (and, where a case says so,
scrapes the metrics endpoint and asks for readiness over gRPC from another process),
then writes the names in ``sys.modules`` to a file and stops the server with SIGTERM.
The assertions are on which modules are loaded, never on time or memory; each case
also names modules that must be loaded, so a probe that saw nothing could not pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pace import scaled

ROOT = Path(__file__).resolve().parent.parent
SIMPLE = ROOT / "appliance" / "demo_models" / "simple"

PROBE = textwrap.dedent(
    """
    import json, logging, os, re, signal, subprocess, sys, threading, urllib.request

    out, scrape = sys.argv[1], sys.argv[2] == "scrape"
    sys.argv = ["appliance", *sys.argv[3:]]
    port, metrics, grpc = [], [], []
    ASK = "import sys, tritonclient.grpc as g; "
    ASK += "assert g.InferenceServerClient(sys.argv[1]).is_server_ready()"

    def infer_then_report():
        body = json.dumps({"inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
            for n in ("INPUT0", "INPUT1")]}).encode()
        base = f"http://127.0.0.1:{port[0]}"
        with urllib.request.urlopen(base + "/v2/health/ready", timeout=30) as r:
            assert r.status == 200
        url = base + "/v2/models/simple/infer"
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as r:
            answer = json.loads(r.read())
        if scrape:
            page = f"http://127.0.0.1:{metrics[0]}/metrics"
            with urllib.request.urlopen(page, timeout=30) as r:
                assert b"nv_inference_count" in r.read()
            if grpc:
                target = f"127.0.0.1:{grpc[0]}"
                subprocess.run([sys.executable, "-c", ASK, target], check=True, timeout=60)
        with open(out, "w") as f:
            json.dump({"modules": sorted(sys.modules), "answer": answer}, f)
        os.kill(os.getpid(), signal.SIGTERM)

    class Probe(logging.Handler):
        def emit(self, record):
            m = re.search(r"http://127\\.0\\.0\\.1:(\\d+)", record.getMessage())
            if m and not port:
                port.append(int(m.group(1)))
            m = re.search(r"metrics http://127\\.0\\.0\\.1:(\\d+)", record.getMessage())
            if m and not metrics:
                metrics.append(int(m.group(1)))
            m = re.search(r"grpc 127\\.0\\.0\\.1:(\\d+)", record.getMessage())
            if m and not grpc:
                grpc.append(int(m.group(1)))
            if record.getMessage().startswith("ready in"):
                threading.Thread(target=infer_then_report, daemon=True).start()

    logging.getLogger("appliance.server").addHandler(Probe())
    from appliance.cli import main
    sys.exit(main())
    """
)

# what no configuration of `appliance serve` needs: the other subcommands' code
NEVER = (
    "appliance.perf",
    "appliance.perf.command",
    "appliance.perf.tune",
    "appliance.doctor",
    "appliance.doctor_network",
    "appliance.ota.commands",
    "multiprocessing",
    "importlib.metadata",
)
GRPC = ("grpc", "google.protobuf", "tritonclient", "hpack", "appliance.adapters.grpc.server")
# what the gRPC endpoint loads with its first connection (its listener and HTTP/2 before)
GRPC_SERVICES = ("grpc", "google.protobuf", "tritonclient", "appliance.adapters.grpc.services")
# the metrics endpoint's: the exposition and the device's telemetry (sysfs, NVML)
METRICS = ("prometheus_client", "appliance.adapters.metrics", "appliance.telemetry.device")
MQTT = ("paho", "appliance.adapters.mqtt.bridge")
# the routes behind the HTTP front: inference and readiness never need them
AIOHTTP = ("aiohttp", "appliance.adapters.http.api")


def _served_modules(tmp_path: Path, *args: str, scrape: bool = False) -> set[str]:
    out = tmp_path / "modules.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    mode = "scrape" if scrape else "-"
    command = [sys.executable, "-c", PROBE, str(out), mode, "serve", "--http-port", "0", *args]
    proc = subprocess.run(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stdout
    assert out.is_file(), proc.stdout
    report = json.loads(out.read_text())
    # the probe saw a serving server: its inference was answered (1 + 1 = 2)
    outputs = {o["name"]: o["data"] for o in report["answer"]["outputs"]}
    assert outputs["OUTPUT0"] == [2] * 16
    return set(report["modules"])


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in modules or any(m.startswith(n + ".") for m in modules)]


def test_demo_models_without_grpc_metrics_or_mqtt(tmp_path: Path) -> None:
    modules = _served_modules(tmp_path, "--grpc-port", "-1", "--metrics-port", "-1")
    assert _loaded(modules, NEVER + GRPC + METRICS + MQTT + AIOHTTP) == []
    # what this configuration does need: the demo models' YAML configs, the preprocess
    # model's Pillow, ONNX Runtime and the HTTP front
    wanted = ("yaml", "PIL", "onnxruntime", "appliance.adapters.http.front")
    assert _loaded(modules, wanted) == list(wanted)


def test_every_endpoint_loads_its_own_libraries_only(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("prometheus_client")
    # the endpoints listen, but their libraries wait for a first call: none came
    modules = _served_modules(tmp_path, "--grpc-port", "0", "--metrics-port", "0")
    assert _loaded(modules, NEVER + MQTT + METRICS + AIOHTTP + GRPC_SERVICES) == []
    assert _loaded(modules, ("appliance.adapters.grpc.server", "hpack")) == [
        "appliance.adapters.grpc.server",
        "hpack",
    ]
    # a scrape and a gRPC call: each endpoint's libraries, and only those
    modules = _served_modules(tmp_path, "--grpc-port", "0", "--metrics-port", "0", scrape=True)
    assert _loaded(modules, NEVER + MQTT + AIOHTTP) == []
    assert _loaded(modules, GRPC + METRICS) == list(GRPC + METRICS)


def test_a_pbtxt_repository_loads_its_parser_only(tmp_path: Path) -> None:
    """A Triton repository of one ONNX model: protobuf reads its config.pbtxt; no YAML
    parser, no image library, no gRPC stack."""
    repo = tmp_path / "repo"
    (repo / "simple" / "1").mkdir(parents=True)
    shutil.copy(SIMPLE / "1" / "model.onnx", repo / "simple" / "1" / "model.onnx")
    (repo / "simple" / "config.pbtxt").write_text(
        textwrap.dedent(
            """
            backend: "onnxruntime"
            max_batch_size: 8
            input [
              { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
              { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
            ]
            output [
              { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
              { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
            ]
            """
        )
    )
    modules = _served_modules(
        tmp_path, "--model-repository", str(repo), "--grpc-port", "-1", "--metrics-port", "-1"
    )
    stack = ("grpc", "hpack", "tritonclient.grpc._client", "appliance.adapters.grpc.server")
    assert _loaded(modules, NEVER + stack + METRICS + MQTT + ("yaml", "PIL")) == []
    assert _loaded(modules, ("onnxruntime", "google.protobuf")) == [
        "onnxruntime",
        "google.protobuf",
    ]
