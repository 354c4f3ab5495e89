"""Hostile or broken bundles fail early and in bounded memory and time.

Tar headers that declare huge GNU long names or PAX headers, members beyond what
``bundle inspect`` reads, configs the server cannot parse, backend claims that do
not agree, and a release that changes a model's backend: the fleet tools refuse
them with the same checks the device runs, and a device that gets one anyway (a
bundle made by hand and signed) refuses it once, marks it bad and changes nothing.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest
import urllib3

from appliance.cli import main
from appliance.config.triton_config import to_triton_json
from appliance.ota import OtaError, bundle, release, repo
from appliance.ota.rollout import Rollout
from devtools import modelgen
from tests.ota_helpers import (
    PY_SIMPLE_CONFIG,
    Fleet,
    LocalDevice,
    files_under,
    publish_raw,
    raw_bundle,
    vectors,
    write_python_simple,
)

ONNX = {"model.onnx": modelgen.simple_add_sub()}


def command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """A command in this process: its exit status and what it wrote to stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


CONFIG = modelgen.SIMPLE_CONFIG.encode()


def extended(kind: bytes, declared: int, data: bytes = b"") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "pax")
    info.type, info.size = kind, declared
    return info, data


PAX_COMMENT = b"1048576 comment=" + b"a" * (1048576 - 17) + b"\n"
HEADERS = {
    # a GNU long name and a PAX header, each declaring 1 GiB but holding nothing:
    # refused on the declaration, so nothing is read (a read would fail on the
    # missing bytes with another message)
    "gnu-longname": extended(tarfile.GNUTYPE_LONGNAME, 1 << 30),
    "pax": extended(tarfile.XHDTYPE, 1 << 30),
    # 1 MiB of a real PAX record, one tarfile keeps and ignores
    "pax-real": extended(tarfile.XHDTYPE, 1 << 20, PAX_COMMENT),
}


@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_oversized_member_headers_are_refused_before_they_are_read(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = raw_bundle(tmp_path / "evil.bundle", "simple", 2, ONNX, CONFIG, extra=[HEADERS[kind]])
    with pytest.raises(OtaError, match=r"extended header .* above the limit of 65536"):
        bundle.inspect(evil)
    code, err = command(capsys, "bundle", "inspect", str(evil))
    assert code == 2 and "above the limit" in err  # one line: an exception would escape


def test_the_agent_refuses_a_hostile_bundle_once_and_marks_it_bad(
    fleet: Fleet, device: LocalDevice
) -> None:
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    before = files_under(device.models)
    evil = raw_bundle(fleet.root / "e.bundle", "simple", 2, ONNX, CONFIG, extra=[HEADERS["pax"]])
    publish_raw(fleet, evil, "simple", 2, "onnxruntime")
    assert not agent.run_once()
    assert "above the limit" in agent.state.last_error
    assert agent.state.models["simple"].bad == [2]
    assert agent.run_once()  # not tried again
    assert files_under(device.models) == before and device.serving() == "1"


def test_inspect_reads_at_most_its_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = raw_bundle(tmp_path / "big.bundle", "simple", 2, {"model.onnx": b"x" * (2 << 20)}, CONFIG)
    code, err = command(capsys, "bundle", "inspect", str(big), "--max-size", "1MiB")
    assert code == 2 and "more than 1048576 bytes" in err
    # a member that claims 5 GiB is refused on the claim (the default limit is 4 GiB)
    claim = tarfile.TarInfo("model/huge.onnx")
    claim.size = 5 << 30
    huge = raw_bundle(tmp_path / "huge.bundle", "simple", 2, ONNX, CONFIG, extra=[(claim, b"")])
    with pytest.raises(OtaError, match="more than 4294967296 bytes"):
        bundle.inspect(huge)


DEEP = b"[" * 200_000 + b"]" * 200_000  # JSON nested beyond Python's recursion limit


def deep_manifest_bundle(out: Path) -> Path:
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(DEEP)
        tar.addfile(info, io.BytesIO(DEEP))
    out.write_bytes(gzip.compress(body.getvalue(), compresslevel=1))
    return out


def test_json_nested_too_deep_is_refused_in_one_line(
    fleet: Fleet, device: LocalDevice, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest (or a self-test vectors file) nested 200,000 levels deep, well inside
    the manifest's 1 MiB: a RecursionError in the JSON reader, not a traceback."""
    evil = deep_manifest_bundle(fleet.root / "deep.bundle")
    code, err = command(capsys, "bundle", "inspect", str(evil))
    assert code == 2 and "manifest: not valid JSON" in err and "Traceback" not in err, err
    with pytest.raises(OtaError, match="manifest: not valid JSON"):
        repo.publish(fleet.repo, fleet.keys, evil, Rollout())
    vectors_file = fleet.root / "deep.json"
    vectors_file.write_bytes(DEEP)
    folder = modelgen.write_model(fleet.src, "simple", modelgen.simple_add_sub(), None, 2)
    out = str(fleet.root / "b.bundle")
    code, err = command(capsys, "bundle", "build", str(folder), "--version", "2", "-o", out,
                        "--self-test", str(vectors_file))  # fmt: skip
    assert code == 2 and "expected a JSON list of self-test vectors" in err, err
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    publish_raw(fleet, evil, "simple", 2, "onnxruntime")
    assert not agent.run_once()
    assert "manifest: not valid JSON" in agent.state.last_error
    assert agent.state.models["simple"].bad == [2]
    assert agent.run_once() and device.serving() == "1"  # refused once, not retried


BAD_CONFIGS = {
    "nested": (b"backend: onnxruntime\nparameters: " + b"[" * 3000 + b"]" * 3000, "nested"),
    "int64": (CONFIG.replace(b"dims: [16]}", b"dims: [99999999999999999999]}", 1), "2**63"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_configs_the_server_cannot_read_are_refused_everywhere(
    fleet: Fleet, device: LocalDevice, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config, reason = BAD_CONFIGS[case]
    # bundle build refuses it
    folder = modelgen.write_model(fleet.src, "simple", modelgen.simple_add_sub(), None, 2)
    (folder / "config.yaml").write_bytes(config)
    out = str(fleet.root / "b.bundle")
    code, err = command(capsys, "bundle", "build", str(folder), "--version", "2", "-o", out)
    assert code == 2 and reason in err, err
    # fleet publish refuses it, made by hand
    evil = raw_bundle(fleet.root / "e.bundle", "simple", 2, ONNX, config)
    with pytest.raises(OtaError, match=reason.replace("*", r"\*")):
        repo.publish(fleet.repo, fleet.keys, evil, Rollout())
    # and a device given it anyway refuses it once, as bad
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    publish_raw(fleet, evil, "simple", 2, "onnxruntime")
    assert not agent.run_once()
    assert reason in agent.state.last_error and agent.state.models["simple"].bad == [2]
    assert agent.run_once() and device.serving() == "1"


def test_backend_claims_must_agree_with_the_config(fleet: Fleet, device: LocalDevice) -> None:
    """A bundle signed as ONNX whose config says Python: its model.py never runs."""
    fleet.publish(1)
    agent = device()
    assert agent.run_once()
    marker = fleet.root / "ran"
    code = f"open({str(marker)!r}, 'w').close()\nclass TritonPythonModel:\n    pass\n"
    python_config = PY_SIMPLE_CONFIG.encode()
    files = {**ONNX, "model.py": code.encode()}
    evil = raw_bundle(fleet.root / "e.bundle", "simple", 2, files, python_config)
    with pytest.raises(OtaError, match="manifest says backend 'onnxruntime'"):
        repo.publish(fleet.repo, fleet.keys, evil, Rollout())
    publish_raw(fleet, evil, "simple", 2, "onnxruntime")
    assert not agent.run_once()
    assert "served by 'python'" in agent.state.last_error
    # the manifest says python too, but the signed target says onnxruntime
    evil3 = raw_bundle(fleet.root / "e3.bundle", "simple", 3, files, python_config, "python")
    publish_raw(fleet, evil3, "simple", 3, "onnxruntime")
    assert not agent.run_once()
    assert "signed target says backend 'onnxruntime'" in agent.state.last_error
    assert agent.state.models["simple"].bad == [2, 3]
    assert not marker.exists() and device.serving() == "1"


def test_a_release_that_changes_the_backend_is_refused(fleet: Fleet, device: LocalDevice) -> None:
    """One config serves every version of a model: the rule is a new model name."""
    fleet.publish(1)  # ONNX
    python = write_python_simple(fleet.root / "py", 2)
    out = fleet.root / "py.bundle"
    bundle.build(python, 2, out)
    with pytest.raises(OtaError, match="publish it under a new model name"):
        repo.publish(fleet.repo, fleet.keys, out, Rollout())
    agent = device()
    assert agent.run_once()
    publish_raw(fleet, out, "simple", 2, "python")  # an older fleet tool let it through
    assert not agent.run_once()
    assert "is installed with backend onnxruntime" in agent.state.last_error
    assert agent.state.models["simple"].bad == [2] and device.serving() == "1"
    assert not (device.models / "simple" / "2").exists()


def test_a_folder_without_config_ships_the_config_the_server_completes(
    fleet: Fleet, device: LocalDevice, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve`` auto-completes a folder holding only ``1/model.onnx``; ``bundle build``
    does the same with the server's own code (one engine built and closed) and ships
    the completed config as config.pbtxt, which the device installs and serves."""
    folder = modelgen.write_model(fleet.src, "simple", modelgen.simple_add_sub(), None, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["1"]
    vectors_file = fleet.root / "vectors.json"
    vectors_file.write_text(json.dumps(vectors()))
    out = fleet.root / "bare.bundle"
    code, err = command(capsys, "bundle", "build", str(folder), "--version", "1", "-o", str(out),
                        "--self-test", str(vectors_file))  # fmt: skip
    assert code == 0, err
    manifest, data = bundle.read(out)
    assert manifest.config_file == "config.pbtxt" and manifest.backend == "onnxruntime"
    shipped = release.read_config("simple", "config.pbtxt", data, "the bundle")
    assert shipped.max_batch_size == 8 and shipped.dynamic_batching is not None
    assert [(t.name, t.datatype, t.dims) for t in shipped.inputs] == [
        ("INPUT0", "INT32", (16,)),
        ("INPUT1", "INT32", (16,)),
    ]
    repo.publish(fleet.repo, fleet.keys, out, Rollout())
    assert device().run_once()
    assert device.serving() == "1"
    served = json.loads(urllib3.request("GET", f"{device.url}/v2/models/simple/config").data)
    expected = to_triton_json(shipped)
    for key in ("max_batch_size", "input", "output", "dynamic_batching", "backend"):
        assert served[key] == expected[key], key


def test_a_missing_model_folder_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Named before the self-test file is read (which is missing too here)."""
    missing = tmp_path / "models" / "simple"
    out, vectors_file = tmp_path / "b.bundle", tmp_path / "v.json"
    code, err = command(capsys, "bundle", "build", str(missing), "--version", "2", "-o", str(out),
                        "--self-test", str(vectors_file))  # fmt: skip
    assert code == 2 and str(missing) in err and "v.json" not in err, err
