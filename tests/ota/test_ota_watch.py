"""Device reports over a real mosquitto, and ``fleet watch`` halting a failing rollout."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from appliance.config.server_config import MqttConfig
from ota import repo
from ota.agent import Agent
from ota.report import Reporter
from tests.mosquitto import Broker, Client, find_mosquitto
from tests.ota_helpers import Fleet, start_fleet


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    binary = find_mosquitto()
    if binary is None:
        reason = "mosquitto not found: install Debian's 'mosquitto' (scripts/test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    (tmp_path / "mosquitto").mkdir()
    b = Broker(binary, tmp_path / "mosquitto")
    b.start()
    yield b
    b.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = start_fleet(tmp_path / "fleet")
    yield f
    f.server.stop()


def test_watch_halts_a_rollout_whose_devices_fail(
    fleet: Fleet, broker: Broker, tmp_path: Path, run_appliance: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    running = run_appliance(models, model_control_mode="explicit")
    mqtt = MqttConfig(host="127.0.0.1", port=broker.port, topic_prefix="fleet")
    fleet.publish(1)
    cfg = fleet.device(tmp_path / "state", models, f"http://{running.url}", mqtt=mqtt)
    agent = Agent(cfg)
    try:
        assert agent.run_once()
        fleet.publish(2, delta=1)  # fails its self-test on every device
        assert not agent.run_once()
    finally:
        agent.close()
    watcher = Client(broker.port)
    try:
        watcher.subscribe("fleet/+/ota")
        (report,) = watcher.collect(1, topic="fleet/cam-1/ota")
    finally:
        watcher.close()
    doc = json.loads(report.payload)
    assert (doc["model"], doc["version"], doc["result"]) == ("simple", 2, "rolled_back")
    assert "self-test failed" in doc["error"]

    # four more devices report the same, one is still pending
    reporters = [Reporter(mqtt, f"cam-{i}") for i in range(2, 7)]
    for i, r in enumerate(reporters):
        result = "" if i == 0 else "rolled_back"
        r.publish({"model": "simple", "version": 2, "state": "idle", "result": result})
    for r in reporters:
        r.close()

    out = io.StringIO()
    args = [
        "fleet", "watch", "--mqtt", f"127.0.0.1:{broker.port}", "--prefix", "fleet",
        "--halt-at-failure-rate", "0.5", "--min-reports", "5",
        "--repo", str(fleet.repo), "--keys", str(fleet.keys),
        "--exit-on-halt", "--duration-s", "30",
    ]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    assert "simple v2: rollout halted" in out.getvalue()
    (v2,) = [r for r in repo.listing(fleet.repo) if r["version"] == 2]
    assert v2["rollout"]["halted"] is True
    (v1,) = [r for r in repo.listing(fleet.repo) if r["version"] == 1]
    assert v1["rollout"]["halted"] is False
