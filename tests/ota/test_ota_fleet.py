"""Fleet side of OTA: bundles, rollout membership, key rotation, budget refusal."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from appliance.ota import OtaError, bundle, check, controls, probation, repo
from appliance.ota.agent import Agent
from appliance.ota.config import OtaConfig
from appliance.ota.rollout import Rollout, bucket
from appliance.ota.state import AgentState
from tests.ota_helpers import Fleet


def test_bundle_is_reproducible_and_inspectable(fleet: Fleet) -> None:
    a = fleet.bundle(3)
    first = a.read_bytes()
    b = fleet.bundle(3)  # written again: new mtimes on the source files
    assert b.read_bytes() == first
    manifest = bundle.inspect(a)
    assert (manifest.name, manifest.version, manifest.backend) == ("simple", 3, "onnxruntime")
    assert [f.path for f in manifest.files] == ["model.onnx"]
    assert manifest.self_test and manifest.memory_bytes > 0


def _evil(tmp_path: Path, name: str, kind: bytes) -> Path:
    manifest = {
        "format": 1, "name": "simple", "version": 2, "backend": "onnxruntime",
        "config_file": "config.yaml",
        "files": [{"path": "model.onnx", "sha256": "0" * 64, "size": 1}],
    }  # fmt: skip
    out = tmp_path / "evil.bundle"
    with tarfile.open(out, "w:gz") as tar:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        evil = tarfile.TarInfo(name)
        evil.type = kind
        evil.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
        evil.size = 1 if kind == tarfile.REGTYPE else 0
        tar.addfile(evil, io.BytesIO(b"x") if kind == tarfile.REGTYPE else None)
    return out


@pytest.mark.parametrize(
    ("name", "kind", "reason"),
    [
        ("../../escape", tarfile.REGTYPE, "unsafe path"),
        ("/etc/escape", tarfile.REGTYPE, "unsafe path"),
        ("model/link", tarfile.SYMTYPE, "is a link"),
        ("model/dev", tarfile.CHRTYPE, "device"),
        ("model/other", tarfile.REGTYPE, "not listed in the manifest"),
    ],
)
def test_malicious_members_are_refused(tmp_path: Path, name: str, kind: bytes, reason: str) -> None:
    evil = _evil(tmp_path, name, kind)
    staging = tmp_path / "stage" / "x"
    staging.parent.mkdir()
    with pytest.raises(OtaError, match=reason):
        bundle.extract(evil, staging, 1 << 20)
    assert not staging.exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["evil.bundle", "stage"]


def test_membership_is_stable_as_the_percentage_grows() -> None:
    devices = [f"cam-{i}" for i in range(2000)]
    members = {
        p: {d for d in devices if Rollout(percent=p).includes("simple", d, "stable", ())}
        for p in (1, 10, 50, 100)
    }
    assert members[1] <= members[10] <= members[50] <= members[100] == set(devices)
    assert 100 < len(members[10]) < 300  # about 10 %
    assert not Rollout(percent=100, halted=True).includes("simple", "cam-1", "stable", ())
    assert not Rollout(channel="beta").includes("simple", "cam-1", "stable", ())
    assert not Rollout(groups=("gate",)).includes("simple", "cam-1", "stable", ("yard",))
    assert bucket("simple", "cam-1") == bucket("simple", "cam-1")


def test_key_rotation_is_followed_by_devices(fleet: Fleet, tmp_path: Path) -> None:
    fleet.publish(1)
    (tmp_path / "models").mkdir()
    cfg = fleet.device(tmp_path / "state", tmp_path / "models", "http://127.0.0.1:9")
    assert check.newest_offer(cfg, AgentState()) is not None
    assert repo.rotate(fleet.repo, fleet.keys, "root") == 2
    assert repo.rotate(fleet.repo, fleet.keys, "targets") == 3
    fleet.publish(2)
    offer = check.newest_offer(cfg, AgentState())
    assert offer is not None and offer.version == 2
    root = json.loads((cfg.state_dir / "metadata" / "root.json").read_text())
    assert root["signed"]["version"] == 3


def test_halted_rollout_is_not_offered(fleet: Fleet, tmp_path: Path) -> None:
    fleet.publish(1)
    fleet.publish(2)
    controls.set_rollout(fleet.repo, fleet.keys, "simple", halted=True)
    (tmp_path / "models").mkdir()
    cfg = fleet.device(tmp_path / "state", tmp_path / "models", "http://127.0.0.1:9")
    offer = check.newest_offer(cfg, AgentState())
    assert offer is not None and offer.version == 1  # the newest that is not halted


def test_over_budget_bundle_refused_before_anything_changes(
    fleet: Fleet, tmp_path: Path, run_appliance: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    running = run_appliance(models, model_control_mode="explicit")
    fleet.publish(1, memory=10 << 30)
    cfg = fleet.device(tmp_path / "state", models, f"http://{running.url}", memory_limit=1 << 30)
    agent = Agent(cfg)
    assert not agent.run_once()
    assert "memory budget" in agent.state.last_error
    assert list(models.iterdir()) == []
    assert not any((tmp_path / "state").rglob("*.bundle"))


def test_probation_verdicts(tmp_path: Path) -> None:
    cfg = OtaConfig(
        source="http://x/", trusted_root=tmp_path, state_dir=tmp_path, server="http://x",
        model_repository=tmp_path, device_id="d", max_error_rate=0.1, max_latency_ratio=2.0,
    )  # fmt: skip
    Counts = probation.Counts
    assert probation.judge(Counts(), 5.0, cfg) == ""
    assert probation.judge(Counts(95, 5, mean_ms=5.0), 5.0, cfg) == ""
    assert "error rate 2/10" in probation.judge(Counts(8, 2, mean_ms=1.0), 5.0, cfg)
    assert "over 2x" in probation.judge(Counts(20, 0, mean_ms=11.0), 5.0, cfg)
    assert probation.judge(Counts(5, 0, mean_ms=50.0), 5.0, cfg) == ""  # too few yet
    # the caller's faults are not the model's: 30 refused requests, 0 failures
    assert probation.judge(Counts(10, 0, client_errors=30), 5.0, cfg) == ""
    # a probe unanswered with nothing else answered: a rate of 1
    assert "error rate 1/0" in probation.judge(Counts(0, 0, probes=1, probe_failures=1), 0, cfg)
    # at the end, too few answered requests fail it
    need5 = dataclasses.replace(cfg, probation_min_requests=5)
    assert probation.judge(Counts(4, 0), 0, need5) == ""  # not over yet
    assert "only 4 request(s) answered" in probation.judge(Counts(4, 0), 0, need5, final=True)
    assert probation.judge(Counts(3, 2, client_errors=9), 0, need5, final=False).startswith("error")
    assert probation.judge(Counts(5, 0, client_errors=9), 0, need5, final=True) == ""


def test_publish_warns_when_a_release_has_no_self_test_vectors(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance.cli import main
    from appliance.ota import probes
    from devtools import modelgen

    folder = modelgen.write_model(
        fleet.src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 7
    )
    args = ["fleet", "publish", str(fleet.repo), "--keys", str(fleet.keys)]
    bare, tested = fleet.root / "bare.bundle", fleet.bundle(6)
    bundle.build(folder, 7, bare)
    assert main([*args[:3], str(tested), *args[3:]]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*args[:3], str(bare), *args[3:]]) == 0
    err = capsys.readouterr().err
    assert "simple version 7 has no self-test vectors" in err and "generated" in err
    # what such a device would send: the declared shapes, zeros then random values
    config = {"max_batch_size": 8, "input": [{"name": "X", "data_type": "TYPE_FP32",
              "dims": ["-1", "3"]}], "output": [{"name": "Y"}]}  # fmt: skip
    zeros, noise = probes.body(config, 0), probes.body(config, 1)
    assert zeros["inputs"][0]["shape"] == [1, 1, 3] and zeros["inputs"][0]["data"] == [0] * 3
    assert noise["inputs"][0]["data"] != [0] * 3 and zeros["outputs"] == [{"name": "Y"}]
    assert probes.inputs_of({**config, "sequence_batching": {}})[1].startswith("a sequence")
