"""Resumable, rate-limited bundle downloads, verified against the signed TUF target.

Bytes go to ``<dir>/<sha256>.part``; after an interruption the next attempt asks
for the rest with an HTTP Range request (a server that ignores Range gets a fresh
start). Nothing longer than the signed length is ever written, and the finished
file is checked against the target's length and hashes before it is renamed to
``<sha256>.bundle``; a mismatch deletes it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import urllib3
from tuf.api.exceptions import LengthOrHashMismatchError
from tuf.api.metadata import TargetFile

from ota import OtaError

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
Progress = Callable[[int, int], None]  # (bytes on disk, total)


class Mismatch(OtaError):
    """The downloaded bytes are not the signed target (deleted; not resumed)."""


def _pace(started: float, sent: int, max_bandwidth: int) -> None:
    """Sleep until ``sent`` bytes since ``started`` are within the cap."""
    if max_bandwidth > 0:
        ahead = sent / max_bandwidth - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


def fetch(
    http: urllib3.PoolManager,
    url: str,
    target: TargetFile,
    folder: Path,
    max_bandwidth: int = 0,
    progress: Progress | None = None,
    timeout_s: float = 60.0,
) -> Path:
    """Download ``target`` from ``url`` into ``folder``; returns the verified file.
    OtaError (the partial file kept for the next attempt) when the transfer breaks."""
    digest = target.hashes.get("sha256", "")
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise OtaError(f"target {target.path}: no usable sha256 in the signed metadata")
    folder.mkdir(parents=True, exist_ok=True)
    done_path = folder / f"{digest}.bundle"
    if done_path.exists():
        return done_path
    part = folder / f"{digest}.part"
    have = part.stat().st_size if part.exists() else 0
    if have > target.length:
        have = 0
    if have < target.length:
        have = _transfer(http, url, target, part, have, max_bandwidth, progress, timeout_s)
    try:
        with open(part, "rb") as f:
            target.verify_length_and_hashes(f)
    except LengthOrHashMismatchError as exc:
        part.unlink(missing_ok=True)
        raise Mismatch(
            f"download of {target.path} does not match the signed target: {exc}"
        ) from None
    os.replace(part, done_path)
    return done_path


def _transfer(
    http: urllib3.PoolManager,
    url: str,
    target: TargetFile,
    part: Path,
    have: int,
    max_bandwidth: int,
    progress: Progress | None,
    timeout_s: float,
) -> int:
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        response = http.request(
            "GET", url, headers=headers, preload_content=False, timeout=timeout_s, retries=False
        )
    except urllib3.exceptions.HTTPError as exc:
        raise OtaError(f"cannot download {url}: {exc}") from None
    try:
        if response.status == 200 and have:
            log.info("%s: the server ignored the Range request; starting again", target.path)
            have = 0
        elif response.status not in (200, 206):
            raise OtaError(f"download of {url}: HTTP {response.status}")
        if have:
            log.info("resuming %s at %d of %d bytes", target.path, have, target.length)
        started, sent, last_log = time.monotonic(), 0, 0.0
        with open(part, "r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            try:
                # read1: whatever arrived, so bytes before a break are kept for the resume
                while chunk := response.read1(CHUNK):
                    if have + len(chunk) > target.length:
                        raise OtaError(
                            f"download of {target.path}: longer than the signed "
                            f"{target.length} bytes"
                        )
                    f.write(chunk)
                    have += len(chunk)
                    sent += len(chunk)
                    if progress is not None:
                        progress(have, target.length)
                    if time.monotonic() - last_log > 5:
                        last_log = time.monotonic()
                        log.info("downloading %s: %d of %d bytes", target.path, have, target.length)
                    _pace(started, sent, max_bandwidth)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise OtaError(
                    f"download of {target.path} interrupted at {have} of {target.length} "
                    f"bytes ({exc}); the next attempt resumes there"
                ) from None
            finally:
                f.flush()
                os.fsync(f.fileno())
    finally:
        response.release_conn()
    if have < target.length:
        raise OtaError(
            f"download of {target.path} interrupted at {have} of {target.length} bytes; "
            "the next attempt resumes there"
        )
    return have
