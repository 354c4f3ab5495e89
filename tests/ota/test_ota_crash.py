"""Crash consistency: kill -9 at every phase boundary and inside the commit, with and
without the server going down too (a power cut), then a restart: the state file,
the config on disk and what the server serves agree, on the last committed version
or on the new one once the resumed update committed it.

The agent is a real ``appliance ota agent --once`` process that SIGKILLs itself at a
named point (:mod:`appliance.ota.faults`): deterministic, no timing. The server is a real
``appliance serve`` process; for a power cut it is SIGKILLed as well and started
again from what is on disk.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from appliance.ota import config as ota_config
from appliance.ota.agent import Agent
from appliance.ota.state import StateFile
from tests.ota_device import Device, Truth, appliance
from tests.ota_helpers import Fleet, start_fleet

BEFORE_STAGE = ["phase:download", "phase:verify", "phase:waiting"]
AFTER_STAGE = [
    "phase:stage",
    "phase:load",
    "phase:self_test",
    "phase:shadow",
    "phase:switch",
    "phase:probation",
    "phase:commit",
    "commit:decided",
    "commit:config",
    "commit:cleaned",
]
CASES = [(p, False) for p in BEFORE_STAGE + AFTER_STAGE] + [(p, True) for p in AFTER_STAGE]
IDS = [f"{p}{'+power' * c}" for p, c in CASES]


@dataclass
class Chain:
    """One device for every crash case (a server start costs seconds): each case
    publishes the next version, crashes on the way to it and converges on it."""

    fleet: Fleet
    device: Device
    version: int = 1


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    tmp = tmp_path_factory.mktemp("crash")
    fleet = start_fleet(tmp / "fleet")
    device = Device(tmp, fleet.server.url, fleet.repo / "metadata" / "1.root.json")
    try:
        fleet.publish(1)
        device.start()
        assert Agent(ota_config.load(device.config)).run_once()
        yield Chain(fleet, device)
    finally:
        device.stop()
        fleet.server.stop()


def agree(truth: Truth, version: int) -> None:
    assert truth == Truth(version, False, (version,), [version], str(version)), truth


@pytest.mark.parametrize(("point", "power_cut"), CASES, ids=IDS)
def test_killed_at_any_point_converges(chain: Chain, point: str, power_cut: bool) -> None:
    device = chain.device
    cfg = ota_config.load(device.config)
    agree(device.truth(), chain.version)  # where the previous case left it
    new = chain.version + 1
    chain.fleet.publish(new)
    killed = device.agent(kill_at=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # it died at that point
    if power_cut:
        device.kill()
        device.start()  # loads what is on disk
        # what the restarted server serves is what the disk names, never a candidate
        on_disk = device.truth()
        assert on_disk.served == list(on_disk.disk or ()), on_disk
    resumed = Agent(cfg)  # a fresh agent: its state from disk only
    assert resumed.run_once(), resumed.state.last_error
    agree(device.truth(), new)
    chain.version = new
    folders = sorted(int(p.name) for p in (device.models / "simple").iterdir() if p.is_dir())
    assert folders == [new - 1, new]  # keep_versions 2: the committed one and one before
    state = StateFile(device.state_dir).load()
    assert state is not None and state.history[-1]["result"] == "updated"
    assert Agent(cfg).run_once()  # and the next cycle changes nothing
    agree(device.truth(), new)


def test_a_corrupt_state_file_is_recovered(chain: Chain) -> None:
    """A truncated state.json (a power cut on a file system without data journaling):
    the agent resumes from state.json.prev; with both damaged it rebuilds its state
    from the model repository; `ota status` says so. Never a traceback. (On the chain's
    device, where the crash cases left it.)"""
    fleet, device, v = chain.fleet, chain.device, chain.version
    assert device.agent(check=True).returncode == 0  # a cycle with nothing to do
    state_file = device.state_dir / "state.json"
    prev = device.state_dir / "state.json.prev"
    assert json.loads(prev.read_text())["models"]["simple"]["current"] == v

    state_file.write_bytes(state_file.read_bytes()[:40])  # truncated mid-write
    status = json.loads(device_status(device))
    assert "resumed from state.json.prev" in status["note"]
    fleet.publish(v + 1)
    run = device.agent()
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "resumed from state.json.prev" in run.stderr
    agree(device.truth(), v + 1)

    state_file.write_text('{"phase": "load", "job": {"model": 3')
    prev.write_text("\0" * 64)  # both damaged: rebuilt from what is on disk
    status = json.loads(device_status(device))
    assert status["phase"] == "unknown" and "rebuilt from the model repository" in status["note"]
    run = device.agent()
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    rebuilt = StateFile(device.state_dir).load()
    assert rebuilt is not None and rebuilt.models["simple"].current == v + 1
    assert rebuilt.models["simple"].previous == [v]
    agree(device.truth(), v + 1)
    fleet.publish(v + 2)  # and it goes on updating
    assert device.agent().returncode == 0
    agree(device.truth(), v + 2)
    chain.version = v + 2


def device_status(device: Device) -> str:
    result = appliance("ota", "status", "--config", str(device.config))
    assert "Traceback" not in result.stderr
    return result.stdout


def test_two_agents_never_work_at_once(chain: Chain) -> None:
    """A unit restarted while the old agent lingers: the second one finds the state
    folder locked, says which pid holds it and changes nothing."""
    fleet, device, v = chain.fleet, chain.device, chain.version
    fleet.publish(v + 1)
    cfg = ota_config.load(device.config)
    first = Agent(cfg)
    results: list[str] = []

    def second_agent(phase: str) -> None:
        if phase == "download" and not results:  # the first one holds the lock now
            run = device.agent()
            results.append(run.stderr)
            results.append(str(run.returncode))

    first.hook = second_agent
    assert first.run_once(), first.state.last_error
    stderr, code = results
    assert code == "2" and "another update agent" in stderr and "Traceback" not in stderr
    agree(device.truth(), v + 1)
    chain.version = v + 1


def test_a_phase_the_agent_keeps_dying_in_gives_the_version_up(chain: Chain) -> None:
    """As when the OOM killer takes the agent each time it verifies a hostile bundle:
    after three deaths in one phase the version is refused as bad, not retried forever."""
    fleet, device, v = chain.fleet, chain.device, chain.version
    fleet.publish(v + 1)
    for _ in range(3):
        killed = device.agent(kill_at="step:verify")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = device.agent()
    assert run.returncode == 1 and "interrupted 3 times during verify" in run.stderr
    state = StateFile(device.state_dir).load()
    assert state is not None and state.models["simple"].bad == [v + 1]
    agree(device.truth(), v)
