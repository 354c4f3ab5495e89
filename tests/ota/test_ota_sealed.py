"""Sealed releases through the whole update: ``bundle build --seal-to`` a device's key,
the agent installs it, the server opens it into memory and serves it; no plaintext of
the weights on the device's disk; a device the bundle is not sealed to refuses it and
keeps serving what it had."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.backends import sealed
from appliance.ota import OtaError, bundle, repo, sealing
from appliance.ota.agent import Agent
from appliance.ota.rollout import Rollout
from devtools import modelgen
from tests.ota_device import cli
from tests.ota_helpers import Fleet, files_under, write_python_simple
from tests.ota_models import outputs, release, served, weights


def _plaintext_in(folder: Path, model: bytes) -> list[str]:
    window = model[len(model) // 2 : len(model) // 2 + 64]
    return [p for p in files_under(folder) if window in (folder / p).read_bytes()]


def test_a_sealed_release_serves_from_memory_and_never_lands_in_plain(
    fleet: Fleet, tmp_path: Path, run_appliance: Any
) -> None:
    key = tmp_path / "device" / "model.key"
    public = sealing.model_key(key)  # made now, for the service user alone
    assert key.stat().st_mode & 0o777 == 0o600 and sealing.model_key(key) == public
    models = tmp_path / "models"
    models.mkdir()
    running = run_appliance(models, model_control_mode="explicit", model_key_file=str(key))
    url = f"http://{running.url}"
    agent = Agent(fleet.device(tmp_path / "state", models, url))
    v1, v2 = weights(1), weights(1, retrained=(2, 4))
    release(fleet, 1, v1, seal_to=(public,))
    assert agent.run_once(), agent.state.last_error
    release(fleet, 2, v2, seal_to=(public,))
    assert agent.run_once(), agent.state.last_error
    version, out = served(url)
    assert version == "2" and np.allclose(out, outputs(v2)[0], atol=1e-5)
    assert sealed.is_sealed(models / "m" / "2" / "model.onnx")
    assert bundle.inspect(fleet.root / "m-2.bundle").sealed_to  # the manifest says to whom
    for folder in (models, tmp_path / "state"):
        assert _plaintext_in(folder, v2) == [] and _plaintext_in(folder, v1) == []


def test_a_device_the_bundle_is_not_sealed_to_refuses_it(
    fleet: Fleet, tmp_path: Path, run_appliance: Any
) -> None:
    key, other = tmp_path / "device.key", tmp_path / "group.key"
    sealing.model_key(key)
    models = tmp_path / "models"
    models.mkdir()
    running = run_appliance(models, model_control_mode="explicit", model_key_file=str(key))
    url = f"http://{running.url}"
    agent = Agent(fleet.device(tmp_path / "state", models, url))
    release(fleet, 1, weights(1))
    assert agent.run_once(), agent.state.last_error
    keys_file = tmp_path / "group.pub"
    keys_file.write_text(f"# the group's key\n{sealing.model_key(other)}\n")
    release(fleet, 2, weights(2), seal_to=(str(keys_file),))
    assert not agent.run_once()
    last = agent.state.history[-1]
    assert last["result"] == "rolled_back" and "is sealed for key(s)" in last["error"]
    assert served(url)[0] == "1" and 2 in agent.state.models["m"].bad


def test_what_cannot_be_sealed_is_refused_before_it_is_published(
    fleet: Fleet, tmp_path: Path
) -> None:
    public = sealing.model_key(tmp_path / "k.key")
    folder = write_python_simple(fleet.src, 1)
    with pytest.raises(OtaError, match="a python model cannot be sealed"):
        bundle.build(folder, 1, tmp_path / "p.bundle", seal_to=(public,))
    with pytest.raises(OtaError, match="nor a file of them"):
        sealing.recipients((str(tmp_path / "missing.pub"),))
    b1 = release(fleet, 1, weights(1), seal_to=(public,))
    folder = fleet.src / "m"
    with pytest.raises(OtaError, match="not a public key line"):
        bundle.build(folder, 1, tmp_path / "bad.bundle", seal_to=("x25519:AAAA",))
    (folder / "2").mkdir()
    (folder / "2" / "model.onnx").write_bytes(weights(2))
    b2 = tmp_path / "m-2.bundle"
    bundle.build(folder, 2, b2, seal_to=(public,))
    with pytest.raises(OtaError, match="a sealed bundle has no delta"):
        repo.publish(fleet.repo, fleet.keys, b2, Rollout(), delta_from=(b1,))


def test_the_cli_makes_a_device_key_and_seals_to_it(tmp_path: Path) -> None:
    key = tmp_path / "model.key"
    public = cli("ota", "model-key", str(key)).strip()
    assert public.startswith("x25519:") and cli("ota", "model-key", str(key)).strip() == public
    src = tmp_path / "src"
    folder = modelgen.write_model(src, "m", weights(1), "max_batch_size: 8\n", 1)
    out = tmp_path / "m.bundle"
    cli("bundle", "build", str(folder), "--version", "1", "-o", str(out), "--seal-to", public)
    assert sealed.is_sealed(folder / "1" / "model.onnx") is False
    assert len(bundle.inspect(out).sealed_to) == 1
