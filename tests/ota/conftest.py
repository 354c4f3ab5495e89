"""Fixtures of the OTA tests: a fleet (a signed TUF repository on a loopback HTTP
server), a device (a real server in this process and agents over one state folder),
a real mosquitto, and small real file systems (tmpfs) for the disk-full cases."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.ota import abinstall, software
from appliance.ota import config as ota_config
from appliance.ota.agent import Agent
from tests.mosquitto import Broker, require_mosquitto
from tests.ota_device import Device
from tests.ota_helpers import Fleet, LocalDevice, start_fleet
from tests.ota_software import Site, Supervisor, release


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = start_fleet(tmp_path / "fleet")
    yield f
    f.server.stop()


@pytest.fixture
def device_on(
    fleet: Fleet, run_appliance: Callable[..., Any]
) -> Callable[[Path, Path], LocalDevice]:
    def make(models: Path, state: Path) -> LocalDevice:
        models.mkdir(parents=True, exist_ok=True)
        running = run_appliance(models, model_control_mode="explicit")
        return LocalDevice(fleet, models, state, f"http://{running.url}", running.metrics_url)

    return make


@pytest.fixture
def device(tmp_path: Path, device_on: Callable[[Path, Path], LocalDevice]) -> LocalDevice:
    return device_on(tmp_path / "models", tmp_path / "state")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    binary = require_mosquitto()
    (tmp_path / "mosquitto").mkdir()
    b = Broker(binary, tmp_path / "mosquitto")
    b.start()
    yield b
    b.stop()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(name, size="4m", inodes=None)``: a real, small file system mounted at
    ``tmp_path/name`` (unmounted at the end). Needs root (mount); skipped without."""
    mounted: list[Path] = []

    def mount(name: str, size: str = "4m", inodes: int | None = None) -> Path:
        where = tmp_path / name
        where.mkdir()
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(where)], check=True, capture_output=True)


# one software device and repository per module that asks for it (tests/ota_software.py)
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("software")
    fleet = start_fleet(tmp / "fleet")
    device = Device(
        tmp, fleet.server.url, fleet.repo / "metadata" / "1.root.json",
        restart_command=Supervisor.command(tmp), system_site_packages=True,
        software_ready_timeout_s=60, software_probation_s=1,
    )  # fmt: skip
    cfg = ota_config.load(device.config)
    supervisor = Supervisor(cfg.state_dir / "software", device.config, device.url)
    assert supervisor.folder == tmp
    work = tmp / "work"
    work.mkdir()
    try:
        # the image: version 0.1.1 installed the way the agent installs, and linked
        first = release(work, "0.1.1")
        lay = abinstall.Layout(cfg)
        abinstall.install_env(lay, first, software.read(first, 1 << 30))
        lay.flip("0.1.1")
        lay.save({"committed": "0.1.1", "job": None, "bad": []})
        supervisor.start()
        assert supervisor.version() == "0.1.1"
        fleet.publish(1)
        assert Agent(cfg).run_once()  # a model, as every device has
        yield Site(fleet, device, supervisor, work, cfg)
    finally:
        supervisor.stop()
        fleet.server.stop()
