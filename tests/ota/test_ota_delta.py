"""Delta bundles: a new version rebuilt from patches against the installed one, checked
against the full target's signed content hashes and the manifest's file hashes.

The pair is realistic: an MLP whose last layer was retrained (devtools/modelgen), plus
a file that did not change and one that is new. Then through the agent and a real
server: a device on the delta's base downloads the delta, one whose delta cannot be
used (the mirror's bytes are not the signed ones) or that has no delta from its
version downloads the full bundle.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest

from appliance.ota import OtaError, bundle, delta, repo
from appliance.ota.fetching import DELTA_TRIES
from devtools import modelgen
from tests.ota_device import cli
from tests.ota_helpers import Fleet, LocalDevice, files_under
from tests.ota_models import outputs, release, served, weights

LIMIT = 1 << 30


def _versions(src: Path) -> tuple[Path, Path]:
    folder = src / "m"
    for v, model in ((1, modelgen.mlp(512, 512, 16, seed=1)),
                     (2, modelgen.mlp(512, 512, 16, seed=1, retrained=(2, 7)))):  # fmt: skip
        modelgen.write_model(src, "m", model, "max_batch_size: 8\n", v)
        (folder / str(v) / "labels.txt").write_text("cat\ndog\n")  # unchanged
    (folder / "2" / "extra.bin").write_bytes(bytes(range(256)) * 16)  # new in version 2
    b1, b2 = src / "m-1.bundle", src / "m-2.bundle"
    bundle.build(folder, 1, b1)
    bundle.build(folder, 2, b2)
    return b1, b2


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("delta")
    b1, b2 = _versions(tmp / "src")
    d = tmp / "m-1-2.delta"
    info = delta.build(b1, b2, d)
    assert info.files == {"extra.bin": "full", "labels.txt": "same", "model.onnx": "patch"}
    return {"base": b1, "target": b2, "delta": d}


@pytest.fixture
def pair(built: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    installed = tmp_path / "models" / "m" / "1"
    bundle.extract(built["base"], installed, LIMIT)  # what the device has
    return {**built, "installed": installed, "tmp": tmp_path}


def test_a_delta_rebuilds_the_full_bundle_from_a_fraction_of_its_bytes(
    pair: dict[str, Path],
) -> None:
    target, d = pair["target"], pair["delta"]
    # the retrained layer is 16 x 512 of 512 x 512 + 512 x 512 + 16 x 512 weights
    assert d.stat().st_size < target.stat().st_size / 20
    out = pair["tmp"] / "rebuilt.bundle"
    manifest = delta.apply(d, pair["installed"], out, delta.content_hashes(target), LIMIT)
    assert manifest == bundle.inspect(target)
    # the same writer and the same zlib here: the very bytes of the signed full target
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(target.read_bytes()).digest()


def test_a_base_that_is_not_the_one_the_delta_is_from_is_refused(pair: dict[str, Path]) -> None:
    model = pair["installed"] / "model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1
    model.write_bytes(bytes(data))
    out = pair["tmp"] / "rebuilt.bundle"
    expected = delta.content_hashes(pair["target"])
    with pytest.raises(OtaError, match=r"base file 'model.onnx' is not the one the delta is from"):
        delta.apply(pair["delta"], pair["installed"], out, expected, LIMIT)
    assert not out.exists() and not list(pair["tmp"].glob(".rebuilt*"))
    model.unlink()
    with pytest.raises(OtaError, match=r"base file 'model.onnx' cannot be read"):
        delta.apply(pair["delta"], pair["installed"], out, expected, LIMIT)


def _members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]


def _write(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_damaged_or_unsigned_delta_is_refused(pair: dict[str, Path]) -> None:
    members = _members(pair["delta"])
    expected = delta.content_hashes(pair["target"])
    out = pair["tmp"] / "rebuilt.bundle"
    bad = pair["tmp"] / "bad.delta"

    def refused(changed: list[tuple[str, bytes]], match: str, hashes: dict[str, str]) -> None:
        _write(bad, changed)
        with pytest.raises(OtaError, match=match):
            delta.apply(bad, pair["installed"], out, hashes, LIMIT)
        assert not out.exists()

    def changed(name: str, data: bytes) -> list[tuple[str, bytes]]:
        return [(n, data if n == name else d) for n, d in members]

    patch = dict(members)["patch/model.onnx"]
    flipped = patch[:-8] + bytes([patch[-8] ^ 1]) + patch[-7:]
    refused(changed("patch/model.onnx", flipped), "does not decompress|does not match", expected)
    # a frame that claims more than the manifest says is never decompressed
    import zstandard

    huge = zstandard.ZstdCompressor().compress(b"\0" * 5000)
    refused(changed("full/extra.bin", huge), r"'extra.bin' claims 5000 bytes, not 4096", expected)
    refused(members, "its manifest is not the signed target's", delta.content_hashes(pair["base"]))
    config = dict(members)["config.yaml"]
    refused(
        changed("config.yaml", config + b"# changed\n"), "its config is not the signed", expected
    )
    refused(
        [(n, d) for n, d in members if n != "full/extra.bin"],
        "no way to make 'extra.bin'",
        expected,
    )
    with_link = pair["tmp"] / "link.delta"
    with tarfile.open(with_link, "w") as tar:
        info = tarfile.TarInfo("delta.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(OtaError, match="is not a regular file"):
        delta.apply(with_link, pair["installed"], out, expected, LIMIT)


def test_a_delta_goes_forward_within_one_model(pair: dict[str, Path]) -> None:
    with pytest.raises(OtaError, match="from an older version of one model to a newer one"):
        delta.build(pair["target"], pair["base"], pair["tmp"] / "back.delta")


# ---- through the agent: a device on version N downloads the delta from N -------------


def test_a_device_updates_through_the_delta_from_the_version_it_serves(
    fleet: Fleet, device: LocalDevice
) -> None:
    b1 = release(fleet, 1, weights(1))
    assert device().run_once()
    v2 = weights(1, retrained=(2, 5))
    b2 = release(fleet, 2, v2, delta_from=(b1,))
    agent = device()
    assert agent.run_once(), agent.state.last_error
    last = agent.state.history[-1]
    assert last["result"] == "updated" and last["download"]["how"] == "delta"
    assert last["download"]["bytes"] + last["download"]["saved"] == b2.stat().st_size
    assert last["download"]["saved"] > b2.stat().st_size / 2
    version, out = served(device.url)
    assert version == "2" and np.allclose(out, outputs(v2)[0], atol=1e-5)
    assert files_under(device.state_dir / "downloads") == []


def test_a_delta_that_cannot_be_used_falls_back_to_the_full_bundle(
    fleet: Fleet, device: LocalDevice
) -> None:
    b1 = release(fleet, 1, weights(1))
    assert device().run_once()
    release(fleet, 2, weights(1, retrained=(1, 6)), delta_from=(b1,))
    (stored,) = (fleet.repo / "targets" / "m").glob("*.from-1.delta")
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the mirror serves other bytes than were signed
    stored.write_bytes(bytes(data))
    agent = device()
    assert agent.run_once(), agent.state.last_error
    last = agent.state.history[-1]
    assert last["result"] == "updated" and last["download"]["how"] == "full"
    assert "does not match the signed target" in last["download"]["delta_failed"]
    assert served(device.url)[0] == "2"
    # no delta from the version this device has (3 is from 1 only): the full bundle
    release(fleet, 3, weights(3), delta_from=(b1,))
    agent = device()
    assert agent.run_once(), agent.state.last_error
    assert agent.state.history[-1]["download"] == {"how": "full", "bytes": ANY}
    assert served(device.url)[0] == "3"


def test_the_fleet_publishes_deltas_and_withdraws_them_with_their_version(
    fleet: Fleet, tmp_path: Path
) -> None:
    b1 = release(fleet, 1, weights(1))
    b2 = release(fleet, 2, weights(1, retrained=(2, 3)))
    b3 = fleet.root / "m-3.bundle"
    folder = fleet.src / "m"
    (folder / "3").mkdir()
    (folder / "3" / "model.onnx").write_bytes(weights(1, retrained=(0, 3)))
    bundle.build(folder, 3, b3)
    out = cli("fleet", "publish", str(fleet.repo), str(b3), "--keys", str(fleet.keys),
              "--delta-from", str(b1), "--delta-from", str(b2))  # fmt: skip
    assert "delta from version 1:" in out and "delta from version 2:" in out
    listed = {row["path"] for row in repo.listing(fleet.repo)}
    assert {"m/m-3.from-1.delta", "m/m-3.from-2.delta", "m/m-3.bundle"} <= listed
    repo.remove(fleet.repo, fleet.keys, "m", 3)
    assert not {p for p in (r["path"] for r in repo.listing(fleet.repo)) if "m-3" in p}


def test_a_delta_the_mirror_lacks_is_tried_a_few_times_then_the_full_bundle(
    fleet: Fleet, device: LocalDevice
) -> None:
    b1 = release(fleet, 1, weights(1))
    assert device().run_once()
    release(fleet, 2, weights(1, retrained=(2, 8)), delta_from=(b1,))
    for stored in (fleet.repo / "targets" / "m").glob("*.from-1.delta"):
        stored.unlink()  # signed, but not on the mirror: 404
    for attempt in range(1, DELTA_TRIES):
        agent = device()
        assert not agent.run_once() and "HTTP 404" in agent.state.last_error
        assert agent.state.job is not None and agent.state.job.download["delta_tries"] == attempt
    agent = device()
    assert agent.run_once(), agent.state.last_error
    last = agent.state.history[-1]
    assert last["result"] == "updated" and last["download"]["how"] == "full"
    assert f"({DELTA_TRIES} attempts)" in last["download"]["delta_failed"]
    assert served(device.url)[0] == "2"
