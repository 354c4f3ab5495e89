"""The appliance updates itself: software bundles built from this project's own wheel,
published to a real TUF repository on a local HTTP server, installed A/B on a device
laid out as the image lays it out (a venv per version under the state folder, one
``current`` link, a supervisor that runs the server from ``current`` and honours the
restart command), committed when the new server comes up READY with its models, and
rolled back when it cannot start (kill -9 at every software phase:
tests/ota/test_ota_software_crash.py).

One device and one repository for the module (the ``site`` fixture of
tests/ota/conftest.py: a server start and a venv cost seconds): each case publishes
the next version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import urllib3

from appliance.ota import OtaError, abinstall, controls, devicekey, report, selftest, software
from appliance.ota.agent import Agent
from appliance.ota.config import OtaConfig
from appliance.ota.state import StateFile
from appliance.version import __version__
from tests.ota_device import ROOT, appliance, cli
from tests.ota_software import Site

PAYLOAD = ("constraints.txt", "sbom.cdx.json", "wheels/appliance-1.2.3-py3-none-any.whl")
GOOD = {"format": 1, "kind": "software", "name": "appliance", "version": "1.2.3",
        "python": "3.11", "platform": "x86_64", "extras": [], "sbom_sha256": "0" * 64,
        "files": [{"path": p, "sha256": "0" * 64, "size": 1} for p in PAYLOAD]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"kind": "model"}, "not a software bundle"),
        ({"name": "other"}, "not appliance"),
        ({"version": "1.2.x"}, "expected numbers and dots"),
        ({"platform": "riscv64"}, "not understood"),
        ({"extras": ["ota; rm -rf /"]}, "short lowercase names"),
        ({"files": [{"path": "../../etc/x", "sha256": "0" * 64, "size": 1}]}, "unsafe path"),
        ({"files": GOOD["files"][:2]}, "no wheel of appliance 1.2.3"),
        ({"files": GOOD["files"][1:]}, "constraints.txt and the SBOM"),
    ],
)
def test_a_software_manifest_is_checked_before_use(change: dict[str, object], why: str) -> None:
    software.parse(json.dumps(GOOD).encode())  # the reference is fine
    with pytest.raises(OtaError, match=re.escape(why)):
        software.parse(json.dumps({**GOOD, **change}).encode())
    with pytest.raises(OtaError, match="RecursionError"):
        software.parse(b"[" * 200_000 + b"]" * 200_000)


def test_a_good_release_is_committed_and_serves_the_same_models(site: Site) -> None:
    old = site.committed
    new = site.publish()
    agent = Agent(site.cfg)
    stop = threading.Event()
    service = threading.Thread(target=agent.run_forever, args=(stop,), daemon=True)
    service.start()
    service.join(180)  # the service makes way for the new agent by itself
    stop.set()
    assert not service.is_alive() and agent.software_updated, agent.state.last_error
    site.agrees(new)
    envs = sorted(p.name for p in site.layout.envs.iterdir())
    assert envs == [old, new]  # the one to roll back to is kept
    sbom = json.loads((site.layout.envs / new / software.SBOM).read_bytes())
    assert sbom["bomFormat"] == "CycloneDX"
    assert sbom["metadata"]["component"]["version"] == new
    assert [c["name"] for c in sbom["components"]] == ["appliance"]


def test_a_release_whose_server_cannot_start_is_rolled_back(site: Site) -> None:
    old = site.committed
    bad = site.publish(broken=True)
    agent = Agent(site.cfg)
    assert not agent.run_once()
    site.agrees(old)
    doc = site.layout.load()
    assert bad in doc["bad"] and doc["last"]["result"] == "rolled_back"
    assert "the restart command failed" in doc["last"]["error"]  # not the watch's timeout
    assert not (site.layout.envs / bad).exists()
    assert agent.run_once()  # not tried again
    site.agrees(old)


def test_other_platforms_pythons_and_downgrades_are_refused(site: Site) -> None:
    installed = site.committed
    other = site.publish(python="3.9")
    assert Agent(site.cfg).run_once()  # offered, but not to this Python: nothing happens
    site.agrees(installed)
    assert other not in site.layout.load()["bad"]
    info = {"version": "9.0", "python": software.python_tag(), "platforms": ["x86_64"]}
    assert software.check_device(info, installed) == ""
    older = software.check_device({**info, "version": "0.1.0"}, installed)
    assert older == f"software 0.1.0 would not upgrade {installed}"
    elsewhere = software.check_device({**info, "platforms": ["riscv64"]}, installed)
    assert elsewhere.startswith("software 9.0 is for ['riscv64'], not ")
    assert "is for Python 3.9" in software.check_device({**info, "python": "3.9"}, installed)


def test_a_release_the_fleet_halts_during_the_install_is_withdrawn(site: Site) -> None:
    old = site.committed
    new = site.publish()
    agent = Agent(site.cfg)

    def halt(phase: str) -> None:
        if phase == "software:install":  # saved, before the venv is made
            controls.set_rollout(site.fleet.repo, site.fleet.keys, "appliance", new, halted=True)

    agent.hook = halt
    assert agent.run_once(), agent.state.last_error
    site.agrees(old)  # nothing flipped
    doc = site.layout.load()
    assert doc["last"]["result"] == "withdrawn" and new not in doc["bad"]
    assert not (site.layout.envs / new).exists()


def test_a_software_release_imported_from_a_file_takes_the_same_path(site: Site) -> None:
    new = site.publish()
    exported = site.work / "software.export"
    cli("fleet", "export", str(site.fleet.repo), "-o", str(exported),
        "--target", f"appliance/appliance-{new}.software")  # fmt: skip
    done = appliance("ota", "import", str(exported), "--config", str(site.device.config),
                     check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["software"]["result"] == "updated"
    site.agrees(new)


def test_the_signed_report_names_the_software_its_sbom_and_the_models(site: Site) -> None:
    key = devicekey.load(site.cfg.state_dir)
    assert key is not None
    state = StateFile(site.cfg.state_dir).load()
    assert state is not None
    sw = report.software_of(site.layout.root)
    signed = devicekey.sign(report.payload("cam-gate-3", state, "", sw), key)
    assert devicekey.verify(signed, key.public_key())
    sbom = (site.layout.envs / site.committed / software.SBOM).read_bytes()
    assert signed["software"]["version"] == site.committed
    assert signed["software"]["sbom_sha256"] == hashlib.sha256(sbom).hexdigest()
    assert signed["current"] == {"simple": 1}
    assert not devicekey.verify({**signed, "software": {**sw, "version": "9.9"}}, key.public_key())
    status = json.loads(cli("ota", "status", "--config", str(site.device.config)))
    assert status["software"] == sw  # what ota status shows on the device


def test_the_unit_rule_rolls_back_a_release_whose_agent_cannot_start(site: Site) -> None:
    """What OnFailure= runs (appliance-ota-rescue.service): back to the version the
    failing one replaced, which is marked bad."""
    doc = site.layout.load()
    failing, back = doc["committed"], doc["previous"]
    done = appliance("ota", "rescue", "--config", str(site.device.config))
    assert f"software {failing} rolled back to {back}" in done.stdout
    site.agrees(back)
    assert failing in site.layout.load()["bad"]


def test_a_rescue_with_nothing_to_roll_back_to_fails(tmp_path: Path) -> None:
    """The image's first version, no previous one: the rescue changes nothing and exits
    1, so its unit (ExecStartPost= runs only after a successful ExecStart=) does not
    start the failing agent again, which would bring the rescue back, in a loop."""
    (tmp_path / "models").mkdir()
    software_dir = tmp_path / "ota" / "software"
    (software_dir / "envs" / "0.1.0").mkdir(parents=True)
    (software_dir / "envs" / "0.1.0" / ".installed").write_text("{}")
    (software_dir / "current").symlink_to("envs/0.1.0")
    state: dict[str, object] = {"committed": "0.1.0", "job": None, "bad": []}
    (software_dir / "state.json").write_text(json.dumps(state))
    config = tmp_path / "appliance.yaml"
    config.write_text(
        f"model_repository: {tmp_path}/models\n"
        f"ota:\n  source: http://127.0.0.1:9/\n  trusted_root: {tmp_path}/root.json\n"
        f"  state_dir: {tmp_path}/ota\n  restart_command: /bin/false\n"
    )
    done = appliance("ota", "rescue", "--config", str(config), check=False)
    assert done.returncode == 1, done.stderr
    assert "nothing to roll back to from software 0.1.0" in done.stdout
    assert json.loads((software_dir / "state.json").read_text()) == state  # not marked bad
    assert os.readlink(software_dir / "current") == "envs/0.1.0"


def _demo_device(
    tmp_path: Path, run_appliance: Callable[..., Any], ready_s: float, probation_s: float
) -> tuple[Any, OtaConfig]:
    """A server on the demo models and the agent's config for it (no repository)."""
    models = tmp_path / "models"
    shutil.copytree(ROOT / "appliance" / "demo_models", models)
    running = run_appliance(models)
    cfg = OtaConfig(
        source="http://127.0.0.1:9/", trusted_root=tmp_path / "root.json",
        state_dir=tmp_path / "ota", server=f"http://{running.url}", model_repository=models,
        device_id="cam-1", software_ready_timeout_s=ready_s, software_probation_s=probation_s,
    )  # fmt: skip
    return running, cfg


def test_the_watch_probes_only_models_that_answered_a_probe_before_the_flip(
    tmp_path: Path, run_appliance: Callable[..., Any]
) -> None:
    """The device image's demo models: ``image_classifier`` takes an encoded image
    (BYTES), which a generated probe (empty bytes) cannot make, on any version. Probed
    after the flip like the others, it rolled a good release back in the booted image
    (images/update-test.sh); now only the models that answered a probe before the flip
    must answer one after it, and the others must be READY."""
    _, cfg = _demo_device(tmp_path, run_appliance, 3, 0)
    ready = abinstall.ready_models(cfg, urllib3.PoolManager())
    assert {"image_classifier", "simple", "classifier"} <= set(ready), ready
    probed = abinstall.answering(cfg, ready)
    assert "simple" in probed and "classifier" in probed
    assert "image_classifier" not in probed
    assert abinstall.watch(cfg, __version__, ready, probed) == ""
    every = abinstall.watch(cfg, __version__, ready)  # what the watch asked before
    assert every.startswith("model image_classifier does not answer on the new version")
    assert abinstall.watch(cfg, "9.9.9", ready, probed).startswith(
        "the server did not answer as version 9.9.9"
    )


def test_the_watch_runs_the_vectors_kept_from_each_models_bundle(
    tmp_path: Path, run_appliance: Callable[..., Any]
) -> None:
    """A model's committed version keeps its bundle's self-test vectors: the software
    watch runs them (not a generated probe), so a new server that answers a model
    wrongly is rolled back. Only a model whose vectors pass before the flip must pass
    them after it; vectors kept for another version are never run."""
    _, cfg = _demo_device(tmp_path, run_appliance, 2, 0)
    a, b = list(range(16)), [1] * 16

    def vector(offset: int) -> dict[str, Any]:
        tensor = {"datatype": "INT32", "shape": [1, 16]}
        return {
            "inputs": {"INPUT0": {**tensor, "data": a}, "INPUT1": {**tensor, "data": b}},
            "outputs": {"OUTPUT0": {**tensor, "data": [x + 1 + offset for x in a]}},
        }

    selftest.keep(cfg.state_dir, "simple", 1, (vector(0),))
    assert abinstall.answering(cfg, ["simple"]) == ["simple"]
    assert abinstall.watch(cfg, __version__, ["simple"], ["simple"]) == ""
    # the same server answering otherwise than the vectors say: what a bad release does
    selftest.keep(cfg.state_dir, "simple", 1, (vector(1),))
    why = abinstall.watch(cfg, __version__, ["simple"], ["simple"])
    assert why.startswith("model simple does not answer on the new version: "), why
    assert "OUTPUT0" in why
    assert abinstall.answering(cfg, ["simple"]) == []  # (failing before the flip too)
    # kept for version 2, the version served is 1: a generated probe, which passes
    selftest.keep(cfg.state_dir, "simple", 2, (vector(1),))
    assert selftest.kept(cfg.state_dir, "simple", 1) == ()
    assert abinstall.watch(cfg, __version__, ["simple"], ["simple"]) == ""
    selftest.keep(cfg.state_dir, "simple", 3, ())  # a version without vectors forgets them
    assert not (cfg.state_dir / selftest.KEPT / "simple.json").exists()


def test_probation_catches_a_server_that_stops_after_it_came_up(
    tmp_path: Path, run_appliance: Callable[..., Any]
) -> None:
    """Ready and self-tested is not the end: the new server must keep answering as its
    version, with its models READY, for ``software_probation_s``; one that stops (a
    crash the service manager would restart) fails probation and is rolled back."""
    running, cfg = _demo_device(tmp_path, run_appliance, 5, 0.6)
    http = urllib3.PoolManager()
    assert abinstall.watch(cfg, __version__, ["simple"], ["simple"]) == ""  # stays up
    cfg = dataclasses.replace(cfg, software_probation_s=60)
    stopper = threading.Timer(0.5, running.stop)
    stopper.start()
    try:
        why = abinstall.probation(cfg, __version__, ["simple"], ["simple"], http)
    finally:
        stopper.join(30)
    assert why == f"version {__version__} stopped answering during its probation"
