"""Fleet controls: retry of the devices that failed, per-device pinning, an approval
step before a phase widens, and a device that joins late, on a real signed
repository, a real server and the fleet's own commands."""

from __future__ import annotations

import json
import time
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.ota import OtaError, controls, software, watch
from appliance.ota.repo import _load
from tests.ota_device import ROOT, cli
from tests.ota_helpers import Fleet, LocalDevice
from tests.ota_software import require_cyclonedx


def rollout_of(fleet: Fleet, version: int) -> dict[str, object]:
    targets = _load(fleet.repo / "metadata", "targets")
    info = targets.signed.targets[f"simple/simple-{version}.bundle"].custom["appliance"]
    rollout: dict[str, object] = info["rollout"]
    return rollout


def fleet_cmd(fleet: Fleet, *args: str) -> str:
    return cli("fleet", *args[:1], str(fleet.repo), *args[1:], "--keys", str(fleet.keys))


def test_retry_failed_brings_back_only_the_devices_that_failed(
    fleet: Fleet,
    device: LocalDevice,
    device_on: Callable[[Path, Path], LocalDevice],
    tmp_path: Path,
) -> None:
    fleet.publish(1)
    assert device().run_once()
    fleet.publish(2)
    strict = device(probation_min_requests=50)  # this device cannot pass probation
    assert not strict.run_once()
    assert strict.state.models["simple"].bad == [2] and device.serving() == "1"
    assert device().run_once() and device.serving() == "1"  # bad: not tried again
    # the fix (here: the device's settings), then the fleet asks the failed to retry
    fleet_cmd(fleet, "rollout", "simple", "--retry-failed")
    assert rollout_of(fleet, 2)["retry"] == 1
    fixed = device()
    assert fixed.run_once(), fixed.state.last_error
    assert device.serving() == "2" and fixed.state.models["simple"].bad == []
    assert fixed.state.models["simple"].retried == {"2": 1}
    # a device that joins now gets the channel's current release, straight away
    late = device_on(tmp_path / "late-models", tmp_path / "late-state")
    agent = late(device_id="cam-late")
    assert agent.run_once(), agent.state.last_error
    assert late.serving() == "2"


def test_phases_widen_by_approval_and_a_pinned_device_stays_put(
    fleet: Fleet, device: LocalDevice, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet.publish(1)
    assert device().run_once()
    cli("fleet", "publish", str(fleet.repo), str(fleet.bundle(2)), "--keys", str(fleet.keys),
        "--phases", "0,100")  # fmt: skip
    assert device().run_once() and device.serving() == "1"  # phase 0: nobody yet
    args = ["fleet", "rollout", str(fleet.repo), "simple", "--keys", str(fleet.keys)]
    assert main([*args, "--percent", "100"]) == 2  # widening needs the approval step
    assert "widens by approval only" in capsys.readouterr().err
    said = json.loads(cli(*args, "--approve", "alice").split(": ", 1)[1])
    assert said["basis_points"] == 10000 and said["approvals"] == ["alice:100%"]
    with pytest.raises(OtaError, match="no phase left"):
        controls.set_rollout(fleet.repo, fleet.keys, "simple", approve="bob")
    assert device().run_once() and device.serving() == "2"
    # pinned to 3: it takes 3 and nothing newer; unpinned, it goes on to the newest
    fleet.publish(3)
    fleet.publish(4)
    fleet_cmd(fleet, "rollout", "simple", "--version", "3", "--pin", "cam-1")
    assert rollout_of(fleet, 3)["pinned"] == ["cam-1"]
    assert device().run_once() and device.serving() == "3"
    assert device().run_once() and device.serving() == "3"
    fleet_cmd(fleet, "rollout", "simple", "--version", "3", "--unpin", "cam-1")
    assert "pinned" not in rollout_of(fleet, 3)
    assert device().run_once() and device.serving() == "4"


def test_software_reports_are_counted_and_a_failing_software_rollout_halted(
    fleet: Fleet, tmp_path: Path
) -> None:
    require_cyclonedx()
    wheel = tmp_path / "appliance-0.1.2-py3-none-any.whl"  # the fleet side reads its METADATA
    with zipfile.ZipFile(wheel, "w") as z:
        meta = "Metadata-Version: 2.1\nName: appliance\nVersion: 0.1.2\nSummary: s\n"
        z.writestr("appliance-0.1.2.dist-info/METADATA", meta)
    (tmp_path / "deps").mkdir()
    out = tmp_path / "appliance-0.1.2.software"
    software.build(out, ROOT / "constraints.txt", wheel=wheel, deps=tmp_path / "deps", extras=())
    fleet_cmd(fleet, "publish", str(out))
    now = time.time()
    tally = watch.Tally()
    for i, result in enumerate(["rolled_back", "rolled_back", "updated"]):
        report = {"device_id": f"cam-{i}", "state": "idle", "model": "", "version": 0,
                  "result": "", "results": {}, "time": now,
                  "software": {"version": "0.1.1", "last": {"version": "0.1.2",
                                                            "result": result}}}  # fmt: skip
        assert watch.valid(report)
        tally.add(f"cam-{i}", report, now)
    counts = tally.counts(3600, now)
    assert counts[("appliance", "0.1.2")] == Counter(rolled_back=2, updated=1)
    assert watch.failing(counts[("appliance", "0.1.2")], 0.2, 3)
    # what fleet watch does then
    controls.set_rollout(fleet.repo, fleet.keys, "appliance", "0.1.2", halted=True)
    targets = _load(fleet.repo / "metadata", "targets")
    signed = targets.signed.targets["appliance/appliance-0.1.2.software"].custom["appliance"]
    assert signed["rollout"]["halted"] and signed["kind"] == "software"
