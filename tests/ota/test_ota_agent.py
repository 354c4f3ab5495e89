"""The OTA agent end to end: a real TUF repository over loopback HTTP, the real agent,
a real appliance server with explicit model control."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import urllib3

from appliance.ota import selftest
from appliance.ota.repo import Expiry, refresh
from appliance.ota.state import StateFile
from tests.ota_helpers import BODY, Fleet, LocalDevice, files_under


def test_fresh_install_then_upgrade_under_load(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    assert device.serving() == "1"
    assert agent.state.models["simple"].current == 1 and agent.state.phase == "idle"

    fleet.publish(2)
    failures: list[str] = []
    done = threading.Event()
    count = 0

    def load() -> None:  # unversioned traffic all through the update, bounded
        nonlocal count
        http = urllib3.PoolManager()
        while not done.is_set() and count < 20000:
            r = http.request("POST", f"{device.url}/v2/models/simple/infer", json=BODY)
            count += 1
            if r.status != 200:
                failures.append(r.data.decode())
            done.wait(0.005)  # steady, modest traffic: this process also runs the agent

    seen: dict[str, str] = {}
    # during the self-test, version 2 is loaded but unversioned traffic stays on 1
    agent.hook = lambda phase: seen.setdefault(phase, device.serving())
    t = threading.Thread(target=load)
    t.start()
    try:
        assert agent.run_once(), agent.state.last_error
    finally:
        done.set()
        t.join(30)
    assert failures == [] and count > 0
    assert seen["self_test"] == "1" and seen["probation"] == "2"
    assert device.serving() == "2"
    assert agent.state.models["simple"].current == 2
    assert agent.state.models["simple"].previous == [1]
    # nothing more to do: the next cycle is a no-op
    assert agent.run_once() and agent.state.history[-1]["result"] == "updated"
    config = (device.models / "simple" / "config.pbtxt").read_text()
    assert "versions: 2" in config
    # the committed version's self-test vectors outlive its bundle: a software update
    # runs them against the new server
    assert selftest.kept(device.state_dir, "simple", 2)
    assert selftest.kept(device.state_dir, "simple", 1) == ()


def test_self_test_failure_rolls_back(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    fleet.publish(2, delta=1)  # the bundle's own vectors disagree with the model
    assert not agent.run_once()
    assert "self-test failed" in agent.state.last_error
    assert device.serving() == "1"
    assert agent.state.models["simple"].bad == [2]
    assert not (device.models / "simple" / "2").exists()
    assert agent.run_once()  # not retried
    assert agent.state.models["simple"].current == 1


class Crash(Exception):
    pass


PHASES = ["download", "verify", "waiting", "stage", "load", "self_test", "shadow", "switch",
          "probation", "commit"]  # fmt: skip


def test_agent_killed_at_every_state_resumes(fleet: Fleet, device: LocalDevice) -> None:
    fleet.publish(1)
    assert device().run_once()
    for i, phase in enumerate(PHASES):
        version = i + 2
        fleet.publish(version)

        def crash(p: str, at: str = phase) -> None:
            if p == at:
                raise Crash(at)

        agent = device()
        agent.hook = crash
        with pytest.raises(Crash):
            agent.run_once()
        assert StateFile(agent.cfg.state_dir).load().phase == phase
        resumed = device()  # a fresh process: state from disk only
        assert resumed.run_once(), (phase, resumed.state.last_error)
        assert resumed.state.models["simple"].current == version, phase
        assert device.serving() == str(version), phase
    # keep_versions=2: the committed one and one before it
    assert sorted(p.name for p in (device.models / "simple").iterdir() if p.is_dir()) == [
        str(len(PHASES)),
        str(len(PHASES) + 1),
    ]


def test_interrupted_download_resumes(fleet: Fleet, device: LocalDevice) -> None:
    path = fleet.publish(1)
    fleet.server.cut_after = path.stat().st_size // 2
    agent = device()
    assert not agent.run_once()
    assert "interrupted" in agent.state.last_error and agent.state.phase == "download"
    assert agent.run_once(), agent.state.last_error
    ranges = [r for p, r in fleet.server.requests if p.endswith(".bundle")]
    assert ranges == ["", f"bytes={path.stat().st_size // 2}-"]
    assert device.serving() == "1"


def test_refusals_change_nothing(fleet: Fleet, device: LocalDevice, tmp_path: Path) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    before = files_under(device.models)

    def refused(expect: str) -> None:
        a = device()
        assert not a.run_once()
        assert expect in a.state.last_error, a.state.last_error
        assert a.state.job is None and a.state.phase == "idle"
        assert files_under(device.models) == before
        assert device.serving() == "1"

    # (a corrupted bundle on the mirror: test_ota_mirrors.py, the mirror's fault)
    fleet.publish(2)

    # bad signature on the timestamp
    ts = fleet.repo / "metadata" / "timestamp.json"
    original = ts.read_text()
    doc = json.loads(original)
    sig = doc["signatures"][0]["sig"]
    doc["signatures"][0]["sig"] = ("0" if sig[0] != "0" else "1") + sig[1:]
    ts.write_text(json.dumps(doc))
    refused("TUF refused")
    ts.write_text(original)

    # replayed older metadata: the device saw a newer timestamp before
    old = {p.name: p.read_bytes() for p in (fleet.repo / "metadata").glob("*.json")}
    refresh(fleet.repo, fleet.keys)
    shutil.copytree(fleet.repo / "metadata", tmp_path / "newer")
    a = device()
    a.state.models["simple"].bad.append(2)  # only fetch metadata this time
    assert a.run_once()
    (fleet.repo / "metadata" / "timestamp.json").write_bytes(old["timestamp.json"])
    refused("TUF refused")

    # expired timestamp
    refresh(fleet.repo, fleet.keys, Expiry(timestamp=-Expiry().timestamp))
    refresh(fleet.repo, fleet.keys, Expiry(timestamp=-Expiry().timestamp))
    refused("Expired")
