"""Software-update test parts: real wheels of this project at other version numbers,
and a supervisor that runs the server from the device's ``current`` link and
honours the agent's restart command, as systemd does on a device.

A release is this project's own source copied, its version set, built into a wheel
by pip (once per test process; later versions re-version that wheel) and packed by
``bundle build-software`` with a folder of dependency wheels (empty: the device's
venvs see the system's packages, ``system_site_packages``, so the test installs only
the appliance itself, offline). A broken release cannot start its server (``Server()`` exits).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import urllib3

from appliance.ota import abinstall, software
from appliance.ota.config import OtaConfig
from tests.mosquitto import wait_until
from tests.ota_device import ROOT, Device
from tests.ota_helpers import Fleet

BROKEN = """

def _cannot_start(self, *args, **kwargs):
    raise SystemExit("this release cannot start")


Server.__init__ = _cannot_start  # type: ignore[method-assign]
"""


def require_cyclonedx() -> None:
    """The SBOM's generator (the test extra installs it); skipped without, outside CI."""
    if importlib.util.find_spec("cyclonedx_py") is None:
        if os.environ.get("CI"):
            raise AssertionError("cyclonedx-bom is not installed (pip install '.[test]')")
        pytest.skip("cyclonedx-bom is not installed (pip install 'appliance[sbom]')")


_TEMPLATE_VERSION = "0.0.0"
_templates: dict[bool, Path] = {}  # broken -> a wheel of this project at the template version


def wheel(work: Path, version: str, broken: bool = False) -> Path:
    """A wheel of this project as ``version``: pip builds it once per test process
    (at a template version, with or without the break), and each version after is
    that wheel re-versioned (:func:`_reversioned`), as pip would have built it."""
    template = _templates.get(broken)
    if template is None or not template.exists():
        template = _templates[broken] = _built(work / "template", _TEMPLATE_VERSION, broken)
    out = work / "wheels" / version
    out.mkdir(parents=True, exist_ok=True)
    return _reversioned(template, version, out)


def _built(work: Path, version: str, broken: bool) -> Path:
    """A wheel of this project as ``version``, built by pip."""
    src = work / f"src-{version}-{int(broken)}"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.onnx", "*.egg-info")
    for package in ("appliance",):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    for name in ("README.md", "LICENSE"):
        shutil.copyfile(ROOT / name, src / name)
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = pyproject.replace('version = "0.1.0"', f'version = "{version}"', 1)
    (src / "pyproject.toml").write_text(pyproject)
    (src / "appliance" / "version.py").write_text(f'__version__ = "{version}"\n')
    if broken:
        with open(src / "appliance" / "server.py", "a") as f:
            f.write(BROKEN)
    out = work / f"wheels-{int(broken)}"
    built = subprocess.run(  # the build backend (setuptools >= 77) from pip's cache or index
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    shutil.rmtree(src)
    if built.returncode != 0:
        if os.environ.get("CI"):
            raise AssertionError(built.stderr)
        pytest.skip(f"cannot build a wheel of this project here: {built.stderr.strip()[-300:]}")
    return next(out.glob("appliance-*.whl"))


def _reversioned(template: Path, version: str, out: Path) -> Path:
    """``template`` with its version set to ``version`` where a wheel names it (the
    file name, the dist-info folder, METADATA, ``appliance/version.py``) and its
    RECORD's hashes made anew (the installer checks them)."""
    old_info = f"appliance-{_TEMPLATE_VERSION}.dist-info"
    new_info = f"appliance-{version}.dist-info"
    target = out / template.name.replace(_TEMPLATE_VERSION, version, 1)
    records: list[str] = []
    compressed = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(target, "w", compressed) as dst:
        for item in src.infolist():
            name = item.filename.replace(old_info, new_info, 1)
            if name == f"{new_info}/RECORD":
                continue
            data = src.read(item)
            if name == f"{new_info}/METADATA":
                data = data.replace(f"Version: {_TEMPLATE_VERSION}\n".encode(),
                                    f"Version: {version}\n".encode(), 1)  # fmt: skip
            elif name == "appliance/version.py":
                data = f'__version__ = "{version}"\n'.encode()
            dst.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append(f"{name},sha256={digest.decode()},{len(data)}")
        records.append(f"{new_info}/RECORD,,")
        dst.writestr(f"{new_info}/RECORD", "\n".join(records) + "\n")
    return target


def release(work: Path, version: str, broken: bool = False, python: str = "") -> Path:
    """A software bundle of ``version`` (what ``bundle build-software --wheel W
    --wheels DIR`` writes)."""
    require_cyclonedx()
    deps = work / "deps"
    deps.mkdir(exist_ok=True)
    out = work / f"appliance-{version}.software"
    software.build(
        out, ROOT / "constraints.txt", wheel=wheel(work, version, broken), deps=deps,
        python=python, extras=(),
    )  # fmt: skip
    return out


RESTART = """
import pathlib, sys, time

# what `systemctl restart` does for a Type=notify unit: ask, then wait for the
# outcome (READY, or the service failed), bounded
folder = pathlib.Path(sys.argv[1])
(folder / "restart-result").unlink(missing_ok=True)
(folder / "restart-request").touch()
end = time.monotonic() + 90
while time.monotonic() < end:
    result = folder / "restart-result"
    if result.exists():
        sys.exit(0 if result.read_text() == "ready" else 1)
    time.sleep(0.05)
sys.exit(1)
"""


class Supervisor:
    """Runs ``<software>/current/bin/python -m appliance serve`` and restarts it when
    the restart command (:meth:`command`) asks, answering READY or failed as
    ``systemctl restart`` does."""

    def __init__(self, software_dir: Path, config: Path, url: str) -> None:
        self.dir, self.config, self.url = software_dir, config, url
        self.folder = software_dir.parent.parent
        self.request = self.folder / "restart-request"
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def command(folder: Path) -> str:
        """The ``restart_command`` for a device in ``folder``."""
        script = folder / "restart.py"
        script.write_text(RESTART)
        return f"{sys.executable} {script} {folder}"

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        drop = ("PYTHONPATH", "APPLIANCE_OTA_KILL_AT")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        python = self.dir / "current" / "bin" / "python"
        self.process = subprocess.Popen(
            [str(python), "-m", "appliance", "serve", "--config", str(self.config)],
            env=env, cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _end(self, power_cut: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            (self.process.kill if power_cut else self.process.terminate)()
            self.process.wait(30)

    def _ready(self) -> bool:
        try:
            r = urllib3.request("GET", f"{self.url}/v2/health/ready", retries=False, timeout=1)
            return r.status == 200
        except urllib3.exceptions.HTTPError:
            return False

    def _loop(self) -> None:
        while not self._stop.wait(0.05):  # bounded by stop()
            if self.request.exists():
                self.request.unlink()
                self._end()
                self.restarts += 1
                self._spawn()
                outcome, end = "failed", time.monotonic() + 60
                while time.monotonic() < end and not self._stop.is_set():
                    if self.process is not None and self.process.poll() is not None:
                        break
                    if self._ready():
                        outcome = "ready"
                        break
                    time.sleep(0.1)
                (self.folder / "restart-result").write_text(outcome)

    def power_cut(self) -> None:
        """The server killed and started again from ``current`` (a reboot)."""
        self._end(power_cut=True)
        self._spawn()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # (a site whose set-up failed never started it)
            self._thread.join(5)
        self._end()

    def version(self, timeout_s: float = 60) -> str:
        """The version the server answers as, once it is READY."""
        found: list[str] = []

        def ready() -> bool:
            try:
                r = urllib3.request("GET", f"{self.url}/v2/health/ready", retries=False)
                if r.status != 200:
                    return False
                found.append(str(urllib3.request("GET", f"{self.url}/v2").json()["version"]))
                return True
            except (urllib3.exceptions.HTTPError, ValueError):
                return False

        wait_until(ready, timeout_s, "the supervised server to be ready")
        return found[-1]


@dataclass
class Site:
    fleet: Fleet
    device: Device
    supervisor: Supervisor
    work: Path
    cfg: OtaConfig
    patch: int = 1  # the last published release is 0.1.<patch>

    @property
    def layout(self) -> abinstall.Layout:
        return abinstall.Layout(self.cfg)

    @property
    def committed(self) -> str:
        return str(self.layout.load()["committed"])

    def publish(self, broken: bool = False, **kw: str) -> str:
        self.patch += 1
        version = f"0.1.{self.patch}"
        from appliance.ota import repo
        from appliance.ota.rollout import Rollout

        repo.publish(self.fleet.repo, self.fleet.keys, release(self.work, version, broken, **kw),
                     Rollout())  # fmt: skip
        return version

    def agrees(self, version: str) -> None:
        """The state, the link and the server agree on ``version``; no job left."""
        doc = self.layout.load()
        assert doc["job"] is None, doc
        assert (doc["committed"], self.layout.linked()) == (version, version)
        assert self.supervisor.version() == version
        assert self.device.version() == "1"  # and the model still serves
