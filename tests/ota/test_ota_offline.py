"""Offline import: a device with no route to its repository installs from one file
(``appliance fleet export`` -> ``appliance ota import``), verified from its pinned
root exactly as online. A tampered file, stale metadata (older than the device has
seen) and a bundle for another platform are refused; nothing changes then.
(A software bundle imported the same way: tests/ota/test_ota_software.py.)
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from appliance.ota import OtaError, bundle, offline, repo
from appliance.ota.rollout import Rollout
from devtools import modelgen
from tests.ota_device import cli
from tests.ota_helpers import Fleet, LocalDevice, vectors

NOWHERE = "http://127.0.0.1:9/"  # the device's configured repository: unreachable


def export(fleet: Fleet, name: str) -> Path:
    out = fleet.root / name
    said = cli("fleet", "export", str(fleet.repo), "-o", str(out))
    assert str(out) in said
    return out


def tampered(file: Path, name: str) -> Path:
    """The export with one byte of the bundle ``name`` flipped."""
    with tarfile.open(file) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(name))
    data = bytearray(file.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0xFF
    out = file.with_name("tampered-" + file.name)
    out.write_bytes(bytes(data))
    return out


def test_an_offline_site_installs_from_a_file_and_refuses_bad_ones(
    fleet: Fleet, device: LocalDevice
) -> None:
    cfg = fleet.device(device.state_dir, device.models, device.url, source=NOWHERE)
    fleet.publish(1)
    first = export(fleet, "first.export")
    ok, done = offline.import_file(cfg, first)
    assert ok and [(d["version"], d["result"]) for d in done] == [(1, "updated")]
    assert device.serving() == "1"
    assert not (cfg.state_dir / "import").exists()  # nothing left behind

    fleet.publish(2)
    second = export(fleet, "second.export")
    ok, done = offline.import_file(cfg, tampered(second, "simple-2.bundle"))
    assert not ok and "does not match the signed target" in done[-1]["error"]
    assert device.serving() == "1"
    ok, done = offline.import_file(cfg, second)
    assert ok and done[0]["result"] == "updated" and device.serving() == "2"

    ok, done = offline.import_file(cfg, first)  # older metadata than the device has seen
    assert not ok and "TUF refused" in done[-1]["error"]
    assert device.serving() == "2"

    other = "aarch64" if bundle.machine() == "x86_64" else "x86_64"
    folder = modelgen.write_model(
        fleet.src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 3
    )
    out = fleet.root / "simple-3.bundle"
    bundle.build(folder, 3, out, platforms=(other,), self_test=vectors())
    repo.publish(fleet.repo, fleet.keys, out, Rollout())
    ok, done = offline.import_file(cfg, export(fleet, "third.export"))
    assert ok and done == []  # not for this platform: nothing taken
    assert device.serving() == "2"


def test_an_export_file_with_anything_but_metadata_and_targets_is_refused(
    fleet: Fleet, tmp_path: Path
) -> None:
    evil = tmp_path / "evil.export"
    with tarfile.open(evil, "w") as tar:
        (tmp_path / "x").write_text("x")
        tar.add(tmp_path / "x", "metadata/../../etc/x.json")
    with pytest.raises(OtaError, match="unsafe path"):
        offline.unpack(evil, tmp_path / "out", 1 << 20)
    assert not list((tmp_path / "out").iterdir())
