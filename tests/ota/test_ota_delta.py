"""Delta bundles: a new version rebuilt from patches against the installed one, checked
against the full target's signed content hashes and the manifest's file hashes.

The pair is realistic: an MLP whose last layer was retrained (devtools/modelgen), plus
a file that did not change and one that is new.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from devtools import modelgen
from ota import OtaError, bundle, delta

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
