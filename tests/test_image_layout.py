"""The device image is laid out for A/B software updates as the update agent expects
(docs/ota.md, "Software updates"; images/install-appliance.sh): the script run on a
folder holding a stand-in of the image's venv, then read by the agent's own
:class:`appliance.ota.abinstall.Layout`. The booted image is checked by
images/boot-test.sh and images/update-test.sh (minutes under qemu, not here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance.ota import abinstall
from appliance.ota import config as ota_config

ROOT = Path(__file__).resolve().parent.parent
SOFTWARE = "var/lib/appliance/ota/software"


def _inside(root: Path, path: str) -> Path:
    """``path`` on the device, its links followed inside ``root`` (absolute links
    point into the device's own tree)."""
    here = root
    parts = list(Path(path).relative_to("/").parts)
    for _ in range(64):
        if not parts:
            return here
        here = here / parts.pop(0)
        if here.is_symlink():
            target = os.readlink(here)
            base = root if target.startswith("/") else here.parent
            parts = list(Path(target.lstrip("/")).parts) + parts
            here = base
    raise AssertionError(f"{path}: too many links")


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("install-appliance.sh gives files to the service user (needs root)")
    for tool in ("systemd-sysusers", "systemctl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian: systemd)")
    r = tmp_path / "rootfs"
    venv = r / "opt/appliance/venv"
    site = venv / "lib/python3.11/site-packages"
    (site / "appliance-1.2.3.dist-info").mkdir(parents=True)
    (site / "appliance-1.2.3.dist-info/METADATA").write_text(
        "Metadata-Version: 2.4\nName: appliance\nVersion: 1.2.3\n"
    )
    shutil.copytree(ROOT / "appliance/demo_models/simple", site / "appliance/demo_models/simple")
    (venv / "bin").mkdir()
    (venv / "bin/appliance").write_text("#!/bin/sh\n")
    (venv / "bin/appliance").chmod(0o755)
    (r / "etc").mkdir()
    done = subprocess.run(
        [str(ROOT / "images/install-appliance.sh"), str(r)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return r


def test_the_image_s_venv_is_the_committed_version_behind_current(rootfs: Path) -> None:
    sw = rootfs / SOFTWARE
    assert os.readlink(sw / "current") == "envs/1.2.3"
    assert os.readlink(sw / "envs/1.2.3") == "/opt/appliance/venv"  # never removed
    assert (rootfs / "opt/appliance/venv/.installed").is_file()  # complete, as the agent's
    # the agent's own reading of the state folder
    config = rootfs / "appliance.yaml"
    config.write_text(
        f"model_repository: {rootfs}/var/lib/appliance/models\n"
        f"ota:\n  source: http://127.0.0.1:9/\n  trusted_root: {rootfs}/root.json\n"
        f"  state_dir: {rootfs}/var/lib/appliance/ota\n"
    )
    lay = abinstall.Layout(ota_config.load(config))
    doc = lay.load()
    assert (doc["committed"], lay.linked(), doc["job"], doc["bad"]) == ("1.2.3", "1.2.3", None, [])
    # the agent (user appliance) flips the link and writes the state; the venv stays root's
    uid = int(next(line.split(":")[2] for line in (rootfs / "etc/passwd").read_text().splitlines()
                   if line.startswith("appliance:")))  # fmt: skip
    for path in (sw, sw / "envs", sw / "state.json", sw / "current", sw / "envs/1.2.3"):
        assert path.lstat().st_uid == uid, path
    assert (rootfs / "opt/appliance/venv").stat().st_uid == 0
    assert (rootfs / "var/lib/appliance/models/simple/config.yaml").is_file()


def test_both_units_run_from_current_and_the_update_parts_are_installed(rootfs: Path) -> None:
    units = rootfs / "etc/systemd/system"
    for unit in ("appliance.service", "appliance-ota.service"):
        drop_in = (units / f"{unit}.d/ab.conf").read_text()
        starts = [line for line in drop_in.splitlines() if line.startswith("ExecStart=")]
        program = starts[-1].removeprefix("ExecStart=").split()[0]
        assert program == f"/{SOFTWARE}/current/bin/appliance", unit
        assert _inside(rootfs, program) == rootfs / "opt/appliance/venv/bin/appliance"
    assert "OnFailure=appliance-ota-rescue.service" in (units / "appliance-ota.service.d/ab.conf"
                                                        ).read_text()  # fmt: skip
    rescue = (units / "appliance-ota-rescue.service").read_text()
    assert "ExecStart=/opt/appliance/venv/bin/appliance ota rescue" in rescue
    rule = (rootfs / "etc/polkit-1/rules.d/50-appliance-ota.rules").read_text()
    # the agent's default restart command is what the rule allows its user
    restart = ota_config.OtaConfig.__dataclass_fields__["restart_command"].default
    assert restart == ("systemctl", "restart", "appliance")
    assert '"appliance.service"' in rule and '"restart"' in rule and '"appliance"' in rule
    wants = units / "multi-user.target.wants"
    assert (wants / "appliance.service").is_symlink()
    assert not (wants / "appliance-ota.service").exists()  # enabled once `ota:` is configured
