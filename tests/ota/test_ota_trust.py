"""What the device trusts: the configured root always, and a clock only as far as the
repository vouches for it.

The clock cases run the real agent under libfaketime (Debian's ``faketime``, which
scripts/test.sh installs): its own process sees the shifted clock, python-tuf's
expiry checks included; the server and the fleet keep the real one.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.ota.state import StateFile
from tests.ota_device import Device
from tests.ota_helpers import Fleet, LocalDevice, start_fleet


def faketime_env(offset: str) -> dict[str, str]:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        reason = "libfaketime not found: install Debian's 'faketime' (scripts/test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return {
        "LD_PRELOAD": found[0],
        "FAKETIME": offset,
        "FAKETIME_NO_CACHE": "1",
    }


def floor(device: Device) -> float:
    state = StateFile(device.state_dir).load()
    assert state is not None
    return state.clock_floor


@pytest.fixture(scope="module")
def clock_device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Device]]:
    """One fleet with version 1 published and one device (its server a process of its
    own) for the clock cases: each starts from whatever the other left committed."""
    tmp = tmp_path_factory.mktemp("clock")
    fleet = start_fleet(tmp / "fleet")
    device = Device(tmp, fleet.server.url, fleet.repo / "metadata" / "1.root.json")
    try:
        fleet.publish(1)
        device.start()
        yield fleet, device
    finally:
        device.stop()
        fleet.server.stop()


def published(fleet: Fleet) -> int:
    """The newest version the fleet published."""
    return max(int(p.name.split("-")[1].split(".")[0]) for p in fleet.root.glob("simple-*.bundle"))


def test_a_clock_ahead_then_corrected_recovers(clock_device: tuple[Fleet, Device]) -> None:
    fleet, device = clock_device
    v = published(fleet)
    env = faketime_env("+400d")  # far ahead: the metadata looks expired
    ahead = device.agent(env=env)
    assert ahead.returncode == 1 and "Expired" in ahead.stderr, ahead.stderr
    assert floor(device) <= time.time()  # the imagined time was not recorded
    right = device.agent()  # NTP set the clock right
    assert right.returncode == 0, right.stderr
    assert device.version() == str(v)

    fleet.publish(v + 1)
    a_little = device.agent(env=faketime_env("+2h"))  # ahead, but the metadata is valid
    assert a_little.returncode == 0, a_little.stderr
    assert device.version() == str(v + 1)
    assert floor(device) <= time.time()  # the floor stops where the repository vouches
    fleet.publish(v + 2)
    right = device.agent()
    assert right.returncode == 0, right.stderr
    assert device.version() == str(v + 2)


def test_a_clock_behind_is_still_refused(clock_device: tuple[Fleet, Device]) -> None:
    """What the floor is for: a device that boots at an old time waits for NTP."""
    fleet, device = clock_device
    assert device.agent().returncode == 0
    assert device.version() == str(published(fleet))
    behind = device.agent(env=faketime_env("-3d"))
    assert behind.returncode == 1 and "waiting for it to be set (NTP)" in behind.stderr


def test_the_configured_root_is_always_the_trust_anchor(
    fleet: Fleet, device: LocalDevice, tmp_path: Path
) -> None:
    """An attacker who can write the state folder and answer for the mirror plants their
    own root: the agent starts from the configured root, so the planted one does not
    chain and the attacker's repository is refused."""
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    attacker = Fleet(tmp_path / "attacker", fleet.server)  # its own keys and repository
    attacker.publish(2)
    meta = agent.cfg.state_dir / "metadata"
    for name in ("root.json", "root_history"):
        path = meta / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    (meta / "root_history").mkdir()
    planted = attacker.repo / "metadata" / "1.root.json"
    shutil.copy(planted, meta / "root.json")
    shutil.copy(planted, meta / "root_history" / "1.root.json")
    shutil.copy(planted, meta / "root_history" / "2.root.json")  # a "rotation" too
    fleet.server.root = attacker.repo  # the mirror now answers with the attacker's files
    fresh = device()
    assert not fresh.run_once()
    assert "TUF refused" in fresh.state.last_error
    assert device.serving() == "1" and fresh.state.job is None
    root = json.loads((meta / "root.json").read_text())
    assert root == json.loads((fleet.repo / "metadata" / "1.root.json").read_text())
