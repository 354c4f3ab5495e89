"""The update promotes the copy it tested: a real agent, TUF repository and server.

The candidate is built once (at the load step, beside the serving version, which is
kept as it is) and the switch promotes that very copy, so the device holds at most
one copy more than it serves; probation counts only what came after the self-test.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import urllib3

from appliance.ota.agent import Agent
from tests.ota_helpers import Fleet, start_fleet


def test_the_update_builds_the_candidate_once(
    tmp_path: Path, run_appliance: Any, caplog: Any
) -> None:
    fleet = start_fleet(tmp_path / "fleet")
    try:
        _update(fleet, tmp_path, run_appliance, caplog)
    finally:
        fleet.server.stop()


def _update(fleet: Fleet, tmp_path: Path, run_appliance: Any, caplog: Any) -> None:
    models = tmp_path / "models"
    models.mkdir()
    url = f"http://{run_appliance(models, model_control_mode='explicit').url}"
    agent = Agent(fleet.device(tmp_path / "state", models, url))
    fleet.publish(1)
    assert agent.run_once(), agent.state.last_error
    fleet.publish(2)
    caplog.set_level(logging.INFO, logger="appliance.core.loader")
    caplog.clear()
    assert agent.run_once(), agent.state.last_error
    builds = [
        r.getMessage().split(":")[0] for r in caplog.records if "loaded model" in r.getMessage()
    ]
    assert builds == ["loaded model 'simple' version 2"]
    # the copy serving is the one self-tested: its one vector is in its statistics,
    # with the probes probation sent
    probes = agent.state.history[-1]["probation"]["probes"]
    stats = urllib3.request("GET", f"{url}/v2/models/simple/stats").json()["model_stats"]
    counted = [(s["version"], s["inference_stats"]["success"]["count"]) for s in stats]
    assert probes >= 1 and counted == [("2", 1 + probes)]
