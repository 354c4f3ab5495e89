"""The OTA commands as fleet scripts and a device use them: real processes.

The fleet side runs ``appliance fleet ...`` / ``appliance bundle ...``; the device
runs ``appliance serve`` and ``appliance ota agent --once`` from one appliance.yaml.
Also the boot-loop case: a bundle whose model kills the server while it loads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import modelgen
from tests.ota_device import ROOT, Device, appliance, cli
from tests.ota_helpers import (
    PY_SIMPLE_CONFIG,
    Fleet,
    LocalDevice,
    StaticServer,
    vectors,
    write_python_simple,
)

KILLER = """
import os


class TritonPythonModel:
    def initialize(self, args):
        os._exit(3)  # the model takes the whole server down while it loads

    def execute(self, requests):
        return []
"""


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Path, StaticServer, Device]]:
    fleet = tmp_path / "fleet"
    cli("fleet", "keys", str(fleet / "keys"))
    cli("fleet", "init", str(fleet / "repo"), "--keys", str(fleet / "keys"))
    server = StaticServer(fleet / "repo")
    device = Device(tmp_path, server.url, fleet / "repo" / "metadata" / "1.root.json")
    yield fleet, server, device
    device.stop()
    server.stop()


def _publish(fleet: Path, model_dir: Path, version: int, *extra: str) -> None:
    vectors_file = fleet / "vectors.json"
    vectors_file.write_text(json.dumps(vectors()))
    out = fleet / f"b{version}.bundle"
    cli(
        "bundle", "build", str(model_dir), "--version", str(version), "-o", str(out),
        "--self-test", str(vectors_file),
    )  # fmt: skip
    shown = json.loads(cli("bundle", "inspect", str(out)))
    assert shown["version"] == version
    said = cli(
        "fleet", "publish", str(fleet / "repo"), str(out), "--keys", str(fleet / "keys"), *extra
    )  # fmt: skip
    rollout = json.loads(said.splitlines()[0].split(" to ", 1)[1])  # JSON, not a Python dict
    assert isinstance(rollout, dict) and rollout


def test_commands_end_to_end_and_boot_loop_protection(
    setup: tuple[Path, StaticServer, Device],
) -> None:
    fleet, _, device = setup
    src = fleet / "src"
    # a Python model: version 2 is one too (a model keeps its backend across versions)
    model_dir = write_python_simple(src / "v1", 1)
    _publish(fleet, model_dir, 1, "--group", "gate", "--percent", "0")
    device.start()
    agent = ("ota", "agent", "--once", "--config", str(device.config))
    assert appliance(*agent).returncode == 0  # 0 %: nothing for this device yet
    assert not (device.models / "simple").exists()
    said = cli("fleet", "rollout", str(fleet / "repo"), "simple", "--percent", "100",
               "--keys", str(fleet / "keys"))  # fmt: skip
    assert json.loads(said.split(": ", 1)[1])["basis_points"] == 10000
    appliance(*agent)
    assert device.version() == "1"

    # version 2 kills the server while it loads
    killer = src / "v2" / "simple"
    (killer / "2").mkdir(parents=True)
    (killer / "2" / "model.py").write_text(KILLER)
    (killer / "config.yaml").write_text(PY_SIMPLE_CONFIG)
    _publish(fleet, killer, 2)
    result = appliance(*agent, check=False)
    assert result.returncode == 1
    assert device.process is not None and device.process.wait(30) == 3  # the server died
    status = json.loads(cli("ota", "status", "--config", str(device.config)))
    assert status["phase"] == "idle" and "server stopped during load" in status["last_error"]
    assert status["models"]["simple"]["bad"] == [2]
    assert not (device.models / "simple" / "2").exists()
    device.start()  # as systemd would: the committed version comes back, not the killer
    assert device.version() == "1"
    assert appliance(*agent).returncode == 0  # version 2 is not tried again
    assert device.process.poll() is None and device.version() == "1"


# fleet commands, one after another, in a process that cannot import grpcio (as with
# the `ota` extra alone); each one's output after a marker line
NO_GRPC = """
import json, sys
sys.modules["grpc"] = None
from appliance.cli import main
for step in json.loads(sys.argv[1]):
    print("=== step", flush=True)
    if main(step) != 0:
        sys.exit(f"failed: {step}")
"""


def test_the_fleet_tools_work_with_the_ota_extra_alone(tmp_path: Path) -> None:
    """No grpcio: every fleet and bundle command still works (the model config schema
    comes without the gRPC stack), with the example self-test vectors, and `fleet
    refresh` says what it signed."""
    keys, repo = tmp_path / "keys", tmp_path / "repo"
    model = modelgen.write_model(
        tmp_path / "src", "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 1
    )
    out = tmp_path / "simple-1.bundle"
    vectors_file = ROOT / "configs" / "ota" / "simple-selftest.json"
    steps = [
        ["fleet", "keys", str(keys)],
        ["fleet", "init", str(repo), "--keys", str(keys)],
        ["bundle", "build", str(model), "--version", "1", "-o", str(out),
         "--self-test", str(vectors_file)],
        ["bundle", "inspect", str(out)],
        ["fleet", "publish", str(repo), str(out), "--keys", str(keys)],
        ["fleet", "rollout", str(repo), "simple", "--percent", "50", "--keys", str(keys)],
        ["fleet", "refresh", str(repo), "--keys", str(keys)],
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", NO_GRPC, json.dumps(steps)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    outputs = result.stdout.split("=== step\n")[1:]
    assert len(outputs) == len(steps)
    assert json.loads(outputs[3])["self_test"] == json.loads(vectors_file.read_text())
    assert "timestamp version 4 signed; it expires" in outputs[-1]


def test_the_example_self_test_vectors_pass_on_the_demo_model(
    fleet: Fleet, device: LocalDevice
) -> None:
    folder = modelgen.write_model(
        fleet.src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 1
    )
    vectors_file = ROOT / "configs" / "ota" / "simple-selftest.json"
    out = fleet.root / "simple-1.bundle"
    cli("bundle", "build", str(folder), "--version", "1", "-o", str(out),
        "--self-test", str(vectors_file))  # fmt: skip
    cli("fleet", "publish", str(fleet.repo), str(out), "--keys", str(fleet.keys))
    agent = device()
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "1"


def test_an_unreachable_repository_says_why(fleet: Fleet, device: LocalDevice) -> None:
    """A metadata server that accepts and never answers: the reason names the timeout
    (ngclient's SlowRetrievalError has no message of its own)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        source = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        agent = device(metadata_timeout_s=0.5, source=source)
        assert not agent.run_once()
    reason = agent.state.last_error
    assert reason.startswith("cannot reach the update repository: SlowRetrievalError: ")
    assert "timed out" in reason, reason
