"""Sealed model files: encrypted at rest to a device's key, opened into memory only.

The format against tampering and wrong keys, then real servers loading sealed ONNX
Runtime and OpenVINO models (in the server process and in a worker process), with
no plaintext anywhere on disk: the repository, the server's temporary folder.
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest
import tritonclient.http as httpclient
from serve_process import start_serve

from appliance.backends import sealed, sealed_crypto
from appliance.errors import ApplianceError
from devtools import modelgen

X = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    device = tmp_path / "keys" / "device.key"
    group = tmp_path / "keys" / "group.key"
    return {
        "device": device,
        "device_pub": sealed_crypto.parse_public(sealed_crypto.generate_key(device)),
        "group": group,
        "group_pub": sealed_crypto.parse_public(sealed_crypto.generate_key(group)),
    }


def _window(data: bytes) -> bytes:
    """64 bytes from the middle of the weights: what a plaintext copy would contain."""
    return data[len(data) // 2 : len(data) // 2 + 64]


def _holds(folder: Path, window: bytes) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and window in p.read_bytes()]


def test_a_sealed_file_opens_with_either_recipient_only(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    plain = modelgen.mlp(64, 128, 8, seed=5)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.onnx").write_bytes(plain)
    kids = sealed_crypto.seal_folder(
        tmp_path / "src", tmp_path / "out", [keys["device_pub"], keys["group_pub"]]
    )
    path = tmp_path / "out" / "model.onnx"
    assert (
        len(kids) == 2
        and sealed.is_sealed(path)
        and not sealed.is_sealed(tmp_path / "src" / "model.onnx")
    )
    assert _holds(tmp_path / "out", _window(plain)) == []
    assert sealed.read_model(path, keys["device"]) == plain
    assert sealed.read_model(path, keys["group"]) == plain
    assert sealed.read_model(tmp_path / "src" / "model.onnx", keys["device"]) is None

    other = tmp_path / "keys" / "other.key"
    sealed_crypto.generate_key(other)
    with pytest.raises(
        ApplianceError, match=r"is sealed for key\(s\) \[.*\], not for this device's key"
    ):
        sealed.read_model(path, other)
    with pytest.raises(ApplianceError, match="has no model_key_file"):
        sealed.read_model(path, None)


@pytest.fixture(params=["one call", "block by block"])
def opening(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a file is opened: one AES-GCM call, and the blocks past 2 GiB (here
    past 1 KiB, in 256-byte blocks)."""
    if request.param == "block by block":
        monkeypatch.setattr(sealed_crypto, "_ONE_SHOT", 1024)
        monkeypatch.setattr(sealed_crypto, "_BLOCK", 256)
    return str(request.param)


def _sealed_mlp(tmp_path: Path, keys: dict[str, Any]) -> bytes:
    """A small MLP sealed to the device key as ``out/model.onnx``; its plaintext."""
    plain = modelgen.mlp(64, 128, 8, seed=5)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.onnx").write_bytes(plain)
    sealed_crypto.seal_folder(tmp_path / "src", tmp_path / "out", [keys["device_pub"]])
    return plain


def test_both_ways_of_opening_give_the_plaintext(
    tmp_path: Path, keys: dict[str, Any], opening: str
) -> None:
    plain = _sealed_mlp(tmp_path, keys)
    assert sealed.read_model(tmp_path / "out" / "model.onnx", keys["device"]) == plain


def test_a_changed_truncated_or_wrongly_keyed_file_is_refused(
    tmp_path: Path, keys: dict[str, Any], opening: str
) -> None:
    _sealed_mlp(tmp_path, keys)
    good = (tmp_path / "out" / "model.onnx").read_bytes()
    bad = tmp_path / "bad.onnx"
    header_end = 12 + int.from_bytes(good[8:12], "big")

    def refused(data: bytes, match: str) -> None:
        bad.write_bytes(data)
        with pytest.raises(ApplianceError, match=match):
            sealed.read_model(bad, keys["device"])

    flipped = bytearray(good)
    flipped[header_end + 100] ^= 1
    refused(bytes(flipped), "failed authentication")
    flipped = bytearray(good)
    flipped[-1] ^= 1  # the tag
    refused(bytes(flipped), "failed authentication")
    # the header is authenticated too: a changed byte of it (here inside the
    # base64 of a wrapped key, so it still parses) is refused
    at = good.index(b'"wrapped":"') + 12
    flipped = bytearray(good)
    flipped[at] = ord("A") if flipped[at] != ord("A") else ord("B")
    refused(bytes(flipped), "does not open|failed authentication")
    refused(good[:-1000], "bytes, but its header says")
    refused(good[:10], "not a sealed model file")
    refused(good[:8] + (2**31).to_bytes(4, "big") + good[12:], "its header claims")
    refused(good[:12] + b"!" + good[13:], "not a sealed-model header")

    os.chmod(keys["device"], 0o644)
    with pytest.raises(ApplianceError, match="readable by other users"):
        sealed.read_model(tmp_path / "out" / "model.onnx", keys["device"])


def _ir(folder: Path, onnx_bytes: bytes) -> None:
    model = ov.Core().read_model(onnx_bytes, b"")
    folder.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)


def _repository(root: Path, keys: dict[str, Any]) -> tuple[Path, dict[str, bytes]]:
    """Three sealed models: ONNX Runtime, ONNX Runtime in a worker process, and an
    OpenVINO IR (xml and bin both sealed); returns the repository and each plaintext."""
    onnx_model = modelgen.mlp(64, 256, 8, seed=9)
    src, repo = root / "src", root / "models"
    (src / "ort").mkdir(parents=True)
    (src / "ort" / "model.onnx").write_bytes(onnx_model)
    _ir(src / "ov", onnx_model)
    plain = {"onnx": onnx_model, "bin": (src / "ov" / "model.bin").read_bytes()}
    configs = {
        "ort": "max_batch_size: 8\n",
        "ort_process": "max_batch_size: 8\nparameters: {execution: process}\n",
        "ov": "backend: openvino\nmax_batch_size: 8\n",
    }
    for name, config in configs.items():
        source = src / ("ov" if name == "ov" else "ort")
        sealed_crypto.seal_folder(source, repo / name / "1", [keys["device_pub"]])
        (repo / name / "config.yaml").write_text(config)
    return repo, plain


def _outputs(port: int, model: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    meta = client.get_model_metadata(model)
    x = httpclient.InferInput(meta["inputs"][0]["name"], list(X.shape), "FP32")
    x.set_data_from_numpy(X)
    out: np.ndarray = client.infer(model, [x]).as_numpy(meta["outputs"][0]["name"])
    return out


def test_sealed_models_serve_and_nothing_plain_reaches_the_disk(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    repo, plain = _repository(tmp_path, keys)
    import onnxruntime as ort

    session = ort.InferenceSession(plain["onnx"], providers=["CPUExecutionProvider"])
    expected = session.run(None, {session.get_inputs()[0].name: X})[0]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    config = tmp_path / "appliance.yaml"
    config.write_text(f"model_repository: {repo}\nmodel_key_file: {keys['device']}\n")
    # the server's temporary files, if it made any, would land in ``scratch``
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc, port, lines = start_serve("--config", str(config), "--grpc-port", "-1", env=env)
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready").status == 200, (
            lines
        )
        for model in ("ort", "ort_process", "ov"):
            np.testing.assert_allclose(_outputs(port, model), expected, rtol=1e-4, atol=1e-5)
        for window in (_window(plain["onnx"]), _window(plain["bin"])):
            assert _holds(repo, window) == [] and _holds(scratch, window) == []
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_sealed_model_without_the_key_is_a_clear_load_failure(
    tmp_path: Path, keys: dict[str, Any], run_appliance: Any
) -> None:
    repo, _ = _repository(tmp_path, keys)
    shutil.rmtree(repo / "ort_process")
    srv = run_appliance(repo)
    rows = {
        r["name"]: r for r in httpclient.InferenceServerClient(srv.url).get_model_repository_index()
    }
    assert rows["ort"]["state"] == "UNAVAILABLE"
    assert (
        "is sealed (encrypted at rest), but the server has no model_key_file"
        in rows["ort"]["reason"]
    )
    other = tmp_path / "keys" / "other.key"
    sealed_crypto.generate_key(other)
    srv = run_appliance(repo, model_key_file=str(other))
    rows = {
        r["name"]: r for r in httpclient.InferenceServerClient(srv.url).get_model_repository_index()
    }
    assert "not for this device's key" in rows["ov"]["reason"]


def test_the_server_refuses_a_key_file_others_can_read(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    from appliance.config.fields import ConfigError
    from appliance.config.server_config import load_server_config

    os.chmod(keys["device"], 0o640)
    with pytest.raises(ConfigError, match=r"model_key_file: .* is readable by other users"):
        load_server_config(None, {"model_key_file": str(keys["device"])})
    os.chmod(keys["device"], 0o600)
    os.environ["APPLIANCE_TEST_CREDENTIALS"] = str(keys["device"].parent)
    try:
        config = load_server_config(
            None, {"model_key_file": "${APPLIANCE_TEST_CREDENTIALS}/device.key"}
        )
    finally:
        del os.environ["APPLIANCE_TEST_CREDENTIALS"]
    assert config.model_key_file == keys["device"]
