"""The OTA commands as fleet scripts and a device use them: real processes.

The fleet side runs ``appliance fleet ...`` / ``appliance bundle ...``; the device
runs ``appliance serve`` and ``appliance ota agent --once`` from one appliance.yaml.
Also the boot-loop case: a bundle whose model kills the server while it loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
import yaml

from appliance.cli import main
from devtools import modelgen
from tests.mosquitto import free_port, wait_until
from tests.ota_helpers import StaticServer, vectors

ROOT = Path(__file__).resolve().parents[2]
KILLER = """
import os


class TritonPythonModel:
    def initialize(self, args):
        os._exit(3)  # the model takes the whole server down while it loads

    def execute(self, requests):
        return []
"""
KILLER_CONFIG = """
backend: python
max_batch_size: 8
input:
  - {name: INPUT0, data_type: TYPE_INT32, dims: [16]}
  - {name: INPUT1, data_type: TYPE_INT32, dims: [16]}
output:
  - {name: OUTPUT0, data_type: TYPE_INT32, dims: [16]}
  - {name: OUTPUT1, data_type: TYPE_INT32, dims: [16]}
"""


def cli(*args: str) -> str:
    """A fleet-side command, in this process (what a fleet script runs); its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def appliance(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command as its own process (the device's agent)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "appliance", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


class Device:
    def __init__(self, tmp: Path, source: str, root_json: Path) -> None:
        self.models = tmp / "models"
        self.models.mkdir()
        self.port = free_port()
        self.config = tmp / "appliance.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "model_repository": str(self.models),
                    "http_port": self.port,
                    "grpc_port": -1,
                    "metrics_port": -1,
                    "model_control_mode": "explicit",
                    "admin_token": "s3cret",
                    "require_admin_token": True,
                    "ota": {
                        "source": source,
                        "trusted_root": str(root_json),
                        "state_dir": str(tmp / "state"),
                        "device_id": "cam-gate-3",
                        "groups": ["gate"],
                        "probation_s": 0.3,
                        "probation_poll_s": 0.1,
                        "max_latency_ratio": 0,
                    },
                }
            )
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "appliance", "serve", "--config", str(self.config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def ready() -> bool:
            try:
                return urllib3.request("GET", f"{self.url}/v2/health/ready").status == 200
            except urllib3.exceptions.HTTPError:
                return False

        wait_until(ready, 60, "the appliance to be ready")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def version(self) -> str:
        body = {
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                for n in ("INPUT0", "INPUT1")
            ]
        }
        r = urllib3.request("POST", f"{self.url}/v2/models/simple/infer", json=body)
        assert r.status == 200, r.data
        return str(json.loads(r.data)["model_version"])


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
    cli("fleet", "publish", str(fleet / "repo"), str(out), "--keys", str(fleet / "keys"), *extra)


def test_commands_end_to_end_and_boot_loop_protection(
    setup: tuple[Path, StaticServer, Device],
) -> None:
    fleet, _, device = setup
    src = fleet / "src"
    model_dir = modelgen.write_model(
        src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 1
    )
    _publish(fleet, model_dir, 1, "--group", "gate", "--percent", "0")
    device.start()
    agent = ("ota", "agent", "--once", "--config", str(device.config))
    assert appliance(*agent).returncode == 0  # 0 %: nothing for this device yet
    assert not (device.models / "simple").exists()
    cli("fleet", "rollout", str(fleet / "repo"), "simple", "--percent", "100",
        "--keys", str(fleet / "keys"))  # fmt: skip
    appliance(*agent)
    assert device.version() == "1"

    # version 2 kills the server while it loads
    killer = src / "killer"
    (killer / "2").mkdir(parents=True)
    (killer / "2" / "model.py").write_text(KILLER)
    (killer / "config.yaml").write_text(KILLER_CONFIG)
    os.rename(killer, src / "simple2")
    (src / "simple").rename(src / "simple1")
    (src / "simple2").rename(src / "simple")
    _publish(fleet, src / "simple", 2)
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
