"""The fleet changes its mind while a device is updating: a halted rollout, a removed
target or a newer version. Before every phase change the agent re-reads fresh
metadata; a withdrawn job is undone (never marked bad), a newer version takes its
place, and a download that fails (a 404 on the mirror) backs off and re-reads the
metadata instead of retrying the same job forever."""

from __future__ import annotations

import logging
import time

import pytest

from appliance.ota import controls, repo
from tests.ota_helpers import Fleet, LocalDevice


def withdraw(fleet: Fleet, how: str, version: int) -> None:
    if how == "halt":
        controls.set_rollout(fleet.repo, fleet.keys, "simple", version, halted=True)
    else:
        repo.remove(fleet.repo, fleet.keys, "simple", version)


@pytest.mark.parametrize("how", ["halt", "remove"])
def test_withdrawn_mid_download_is_never_installed(
    fleet: Fleet, device: LocalDevice, how: str
) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    path = fleet.publish(2)
    fleet.server.cut_after = path.stat().st_size // 2
    assert not agent.run_once()
    assert agent.state.phase == "download" and "interrupted" in agent.state.last_error
    withdraw(fleet, how, 2)
    assert agent.run_once(), agent.state.last_error  # a withdrawal is not a failure
    assert agent.state.job is None and agent.state.history[-1]["result"] == "withdrawn"
    assert device.serving() == "1"
    assert not (device.models / "simple" / "2").exists()
    assert 2 not in agent.state.models["simple"].bad  # withdrawn, not bad
    assert not list((agent.cfg.state_dir / "downloads").glob("*.part"))
    assert agent.run_once() and device.serving() == "1"  # and it stays so


def test_halted_while_under_test_is_rolled_back_not_marked_bad(
    fleet: Fleet, device: LocalDevice, caplog: pytest.LogCaptureFixture
) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    agent = device()
    # the fleet halts version 2 while this device runs its self-test
    agent.hook = lambda phase: phase == "self_test" and withdraw(fleet, "halt", 2)
    with caplog.at_level(logging.INFO, logger="appliance.ota"):
        assert agent.run_once(), agent.state.last_error
    said = [r for r in caplog.records if "withdrawn" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said  # said once, not an error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert agent.state.history[-1]["result"] == "withdrawn"
    assert "no longer offers" in agent.state.history[-1]["error"]
    assert device.serving() == "1" and agent.state.models["simple"].current == 1
    assert not (device.models / "simple" / "2").exists()
    assert 2 not in agent.state.models["simple"].bad
    controls.set_rollout(fleet.repo, fleet.keys, "simple", 2, halted=False)  # resumed
    agent.hook = None
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "2"


def test_a_newer_version_supersedes_the_job_under_way(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    agent = device()
    agent.hook = lambda phase: phase == "load" and fleet.publish(3) and None
    assert agent.run_once(), agent.state.last_error
    assert agent.state.history[-1] == {
        **agent.state.history[-1],
        "version": 2,
        "result": "withdrawn",
        "error": "simple version 3 supersedes version 2",
    }
    assert device.serving() == "1"
    agent.hook = None
    assert agent.run_once() and device.serving() == "3"
    assert agent.state.models["simple"].bad == []


def test_a_missing_bundle_backs_off_and_a_newer_version_gets_through(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    agent = device(check_interval_s=60.0, jitter=0.0)
    assert agent.run_once()
    fleet.publish(2)
    next((fleet.repo / "targets" / "simple").glob("*.simple-2.bundle")).unlink()  # 404
    for retries in (1, 2):
        assert not agent.run_once()
        assert "HTTP 404" in agent.state.last_error and agent.state.retries == retries
    # backing off: the second failure in a row waits two intervals
    assert agent.state.next_check - time.time() > 1.5 * 60
    timestamps = [p for p, _ in fleet.server.requests if p.endswith("timestamp.json")]
    fleet.publish(3)
    assert agent.run_once(), agent.state.last_error  # re-read the metadata: superseded
    assert [p for p, _ in fleet.server.requests if p.endswith("timestamp.json")] > timestamps
    assert agent.state.history[-1]["result"] == "withdrawn"
    assert agent.run_once(), agent.state.last_error
    assert device.serving() == "3" and agent.state.retries == 0
