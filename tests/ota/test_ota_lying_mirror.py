"""A mirror that lies about a range never gets a download stuck.

A real HTTP server on 127.0.0.1 answers a resumed download (``Range: bytes=N-``)
with a ``206`` whose ``Content-Range`` promises the rest of the file from N, and a
body that is not it: longer (the whole file from byte 0, the broken cache of the
field report, with and without a Content-Length), shorter (bytes skipped), or as
long as promised but from another offset (only the hash can tell). Each time the
partial file is discarded and the download starts again from byte 0, once; a
mirror that serves wrong bytes even from byte 0 is the mirror's fault: nothing is
kept, and the error is a passing one (the agent backs off and keeps the job).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
from tuf.api.metadata import TargetFile

from appliance.ota import Transient, download
from tests.ota_helpers import StaticServer

SIZE = 256 << 10
HALF = 100_000


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticServer]:
    root = tmp_path_factory.mktemp("mirror")
    (root / "m").mkdir()
    (root / "m" / "x.bundle").write_bytes(os.urandom(SIZE))
    server = StaticServer(root)
    yield server
    server.stop()


@pytest.fixture
def target(mirror: StaticServer) -> TargetFile:
    mirror.lie, mirror.corrupt = "", False
    mirror.requests.clear()
    data = (mirror.root / "m" / "x.bundle").read_bytes()
    return TargetFile(len(data), {"sha256": hashlib.sha256(data).hexdigest()}, "m/x.bundle")


def partial(folder: Path, target: TargetFile, mirror: StaticServer) -> Path:
    """The first HALF bytes, as an earlier attempt cut off there left them."""
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"{target.hashes['sha256']}.part"
    part.write_bytes((mirror.root / "m" / "x.bundle").read_bytes()[:HALF])
    return part


def fetch(mirror: StaticServer, target: TargetFile, folder: Path) -> Path:
    http = urllib3.PoolManager()
    try:
        return download.fetch(http, f"{mirror.url}m/x.bundle", target, folder)
    finally:
        http.clear()


@pytest.mark.parametrize("lie", ["long", "long-declared", "short", "wrong"])
def test_a_lying_range_restarts_from_byte_zero_once(
    mirror: StaticServer, target: TargetFile, tmp_path: Path, lie: str
) -> None:
    part = partial(tmp_path, target, mirror)
    mirror.lie = lie
    done = fetch(mirror, target, tmp_path)
    assert hashlib.sha256(done.read_bytes()).hexdigest() == target.hashes["sha256"]
    assert not part.exists()
    # the resume was asked for, found to be a lie, and replaced by one whole download
    assert [r for _, r in mirror.requests] == [f"bytes={HALF}-", ""]


def test_the_field_report_no_longer_grows_the_partial_file(
    mirror: StaticServer, target: TargetFile, tmp_path: Path
) -> None:
    """The cache that sent 2,098,950 bytes where 1,098,950 were due, attempt after
    attempt: the partial file never grows past what was honestly received."""
    part = partial(tmp_path, target, mirror)
    mirror.lie, mirror.corrupt = "long", True  # and byte 0 on is wrong too
    with pytest.raises(download.Mismatch) as failed:
        fetch(mirror, target, tmp_path)
    assert isinstance(failed.value, Transient)  # passing: the agent backs off
    assert "from byte 0" in str(failed.value) and "mirror" in str(failed.value)
    assert not part.exists()  # nothing to resume from next time
    assert [r for _, r in mirror.requests] == [f"bytes={HALF}-", ""]  # one restart, no more
    mirror.lie, mirror.corrupt = "", False
    assert fetch(mirror, target, tmp_path).stat().st_size == SIZE
    assert [r for _, r in mirror.requests][2:] == [""]


def test_wrong_bytes_from_byte_zero_are_the_mirrors_fault(
    mirror: StaticServer, target: TargetFile, tmp_path: Path
) -> None:
    mirror.corrupt = True
    with pytest.raises(download.Mismatch, match="does not match the signed target"):
        fetch(mirror, target, tmp_path)
    assert [r for _, r in mirror.requests] == [""]  # no resume, so no second try
    assert not list(tmp_path.iterdir())
