"""A real device for the OTA tests: ``appliance serve`` as its own process, and
``appliance ota agent`` runs (as processes too, or in this process) reading one
appliance.yaml; plus :func:`cli`, a fleet-side command run in this process.

:meth:`Device.kill` is a power cut for the server (SIGKILL by PID);
:func:`agent_run` with ``kill_at`` makes the agent SIGKILL itself at a named point
(:mod:`appliance.ota.faults`). :meth:`Device.truth` reads the three places a device's
version lives: the agent's state file, the config on disk and what the server
serves.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
import yaml

from appliance.cli import main
from appliance.ota import faults, install
from appliance.ota.state import StateFile
from tests.mosquitto import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
INPUTS = {
    "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
        for n in ("INPUT0", "INPUT1")
    ]
}


def cli(*args: str) -> str:
    """A fleet-side command, in this process (what a fleet script runs); its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def appliance(
    *args: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A command as its own process (the device's agent)."""
    result = subprocess.run(
        [sys.executable, "-m", "appliance", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=timeout,
        cwd=ROOT,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@dataclass(frozen=True)
class Truth:
    state: int  # the committed version in the state file (0: none)
    job: bool  # a job still under way
    disk: tuple[int, ...] | None  # the versions the config on disk names
    served: list[int]  # the versions the server has READY
    answers: str  # the version an unversioned request is answered by ("" if none)


class Device:
    def __init__(self, tmp: Path, source: str, root_json: Path, **ota: Any) -> None:
        self.tmp = tmp
        self.models = tmp / "models"
        self.models.mkdir()
        self.state_dir = tmp / "state"
        self.port = free_port()
        self.config = tmp / "appliance.yaml"
        options = {
            "source": source,
            "trusted_root": str(root_json),
            "state_dir": str(self.state_dir),
            "device_id": "cam-gate-3",
            "groups": ["gate"],
            "probation_s": 0.3,
            "probation_poll_s": 0.1,
            "probation_min_requests": 1,
            "max_latency_ratio": 0,
            **ota,
        }
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
                    "ota": options,
                }
            )
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop(faults.ENV, None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "appliance", "serve", "--config", str(self.config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def ready() -> bool:
            try:
                r = urllib3.request("GET", f"{self.url}/v2/health/ready", retries=False)
                return r.status == 200
            except urllib3.exceptions.HTTPError:
                return False

        wait_until(ready, 60, "the appliance to be ready")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def kill(self) -> None:
        """A power cut for the server: SIGKILL by PID."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def agent(
        self, *extra: str, kill_at: str = "", check: bool = False, env: dict[str, str] | None = None
    ) -> Any:
        """``appliance ota agent --once`` as its own process (``kill_at``: the point it
        SIGKILLs itself at)."""
        args = ("ota", "agent", "--once", "--config", str(self.config), *extra)
        env = {**(env or {}), **({faults.ENV: kill_at} if kill_at else {})}
        return appliance(*args, check=check, env=env)

    def version(self, model: str = "simple") -> str:
        r = urllib3.request("POST", f"{self.url}/v2/models/{model}/infer", json=INPUTS)
        assert r.status == 200, r.data
        return str(json.loads(r.data)["model_version"])

    def truth(self, model: str = "simple") -> Truth:
        state = StateFile(self.state_dir).load()
        assert state is not None
        ms = state.models.get(model)
        headers = {"Authorization": "Bearer s3cret"}
        r = urllib3.request("POST", f"{self.url}/v2/repository/index", json={}, headers=headers)
        rows = [row for row in json.loads(r.data) if row.get("name") == model]
        served = sorted(int(row["version"]) for row in rows if row.get("state") == "READY")
        r = urllib3.request("POST", f"{self.url}/v2/models/{model}/infer", json=INPUTS)
        answers = str(json.loads(r.data)["model_version"]) if r.status == 200 else ""
        return Truth(
            ms.current if ms else 0,
            state.job is not None,
            install.pinned(self.models, model),
            served,
            answers,
        )
