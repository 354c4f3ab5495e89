"""The agent and a server that is not there: at boot the agent may start before the
server (systemd orders them, but the server may be slow or failing), and a server
may be stopped while an update is under way. A server that cannot be reached is not
the candidate's fault: the agent waits for it with back-off before a load, keeps the
job when it does not come, and never marks the version bad for it.

A real ``appliance serve`` process and real ``appliance ota agent --once`` processes
over one appliance.yaml (tests/ota_device.py); one device for both cases, the second
starting where the first left it (a server process costs seconds to start).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from appliance.ota import faults
from appliance.ota.state import StateFile
from tests.mosquitto import wait_until
from tests.ota_device import ROOT, Device, Truth
from tests.ota_helpers import start_fleet


def agree(truth: Truth, version: int) -> None:
    assert truth == Truth(version, False, (version,), [version], str(version)), truth


def set_server_wait(device: Device, seconds: float) -> None:
    doc = yaml.safe_load(device.config.read_text())
    doc["ota"]["server_wait_s"] = seconds
    device.config.write_text(yaml.safe_dump(doc))


def test_the_agent_waits_for_a_server_that_is_not_there(tmp_path: Path) -> None:
    """A boot where the agent comes up first: it takes v1, stages it and waits in the
    load phase; the server starts later and the same cycle installs v1. Then the server
    is stopped and v2 published: one cycle downloads, verifies and stages v2, waits
    ``server_wait_s`` for the server, then keeps the job (exit 1, the reason said), v2
    not marked bad. Once the server is back, the next cycle installs v2."""
    fleet = start_fleet(tmp_path / "fleet")
    device = Device(tmp_path, fleet.server.url, fleet.repo / "metadata" / "1.root.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(faults.ENV, None)
    fleet.publish(1)
    agent = subprocess.Popen(
        [sys.executable, "-m", "appliance", "ota", "agent", "--once", "--config",
         str(device.config)],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def waiting_in_load() -> bool:
            assert agent.poll() is None, agent.communicate()[1]
            state = StateFile(device.state_dir).load() if device.state_dir.exists() else None
            return state is not None and state.phase == "load"

        wait_until(waiting_in_load, 120, "the agent to wait for the server in the load phase")
        device.start()
        _, err = agent.communicate(timeout=120)
        assert agent.returncode == 0, err
        agree(device.truth(), 1)

        device.stop()
        fleet.publish(2)
        set_server_wait(device, 1)
        run = device.agent()
        assert run.returncode == 1, run.stderr
        assert "cannot be reached" in run.stderr or "did not answer within" in run.stderr
        assert "Traceback" not in run.stderr
        state = StateFile(device.state_dir).load()
        assert state is not None and state.models["simple"].bad == []
        assert state.job is not None and state.job.version == 2 and state.phase == "load"
        assert state.job.load_attempts == 0  # waiting for a server is not an attempt
        device.start()
        run = device.agent()
        assert run.returncode == 0, run.stderr
        agree(device.truth(), 2)
        state = StateFile(device.state_dir).load()
        assert state is not None and state.models["simple"].bad == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(30)
        device.stop()
        fleet.server.stop()
