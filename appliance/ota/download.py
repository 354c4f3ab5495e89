"""Resumable, rate-limited bundle downloads, verified against the signed TUF target.

Bytes go to ``<dir>/<sha256>.part``; after an interruption the next attempt asks
for the rest with an HTTP Range request. The answer must be a ``206`` whose
``Content-Range`` starts where the partial file ends, ends within the signed
length, names the signed length as the total, and agrees with its
``Content-Length``. Nothing longer than the signed length is ever written, and the
finished file is checked against the target's length and hashes before it is
renamed to ``<sha256>.bundle``.

A mirror that lies about a range (the lying-mirror rule): an answer that does not
resume where asked (a ``200``, a ``416``, a ``206`` from another offset or of
another length), a body longer than its range promised, or a finished file whose
hash fails after a resume, discards the partial file and starts again from byte 0,
once, in the same attempt. A second failure from byte 0 is the mirror's fault:
:class:`Mismatch`, a :class:`~appliance.ota.Transient` (the job is kept, the agent backs off
and re-reads the metadata, and the next attempt starts from 0 again). A grown
partial file is never resumed from.

Bounded in time: an attempt whose rate stays below ``min_rate`` bytes/s over a
window (a mirror that trickles) ends as :class:`~appliance.ota.Transient` (the partial file
is kept, the agent backs off and re-reads the metadata before it resumes), and a
job whose download is not done by its deadline is dropped (:class:`Dropped`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import urllib3
from tuf.api.exceptions import LengthOrHashMismatchError
from tuf.api.metadata import TargetFile

from appliance.ota import OtaError, Transient

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
Progress = Callable[[int, int], None]  # (bytes on disk, total)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Dropped(OtaError):
    """The download is given up (files deleted); the job is dropped, nothing is marked
    bad, and the next check starts over."""


class Mismatch(Transient):
    """The mirror served bytes that are not the signed target even from byte 0 (or lied
    about a range twice): the partial file is gone, the job is kept, the agent backs
    off."""


class _Lie(Exception):
    """The mirror's answer is not the range it was asked for (internal)."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_bandwidth: int = 0  # bytes/s; 0: unlimited
    min_rate: int = 0  # bytes/s over window_s, or the attempt ends; 0: no minimum
    window_s: float = 60.0
    deadline: float = 0.0  # wall-clock time the download must be done by; 0: none
    timeout_s: float = 60.0  # connect and per-read socket timeout


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
    limits: Limits | None = None,
    progress: Progress | None = None,
) -> Path:
    """Download ``target`` from ``url`` into ``folder``; returns the verified file.
    Transient (the partial file kept for the next attempt) when the transfer breaks
    or is too slow, Dropped past the deadline, Mismatch (a Transient, nothing kept)
    when the mirror served wrong bytes or lied about a range even from byte 0."""
    limits = limits or Limits()
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
    again = False  # the one restart from byte 0 this attempt allows
    while True:
        resumed = have > 0
        try:
            if have < target.length:
                _transfer(http, url, target, part, have, limits, progress)
            with open(part, "rb") as f:
                target.verify_length_and_hashes(f)
            break
        except (_Lie, LengthOrHashMismatchError) as exc:
            part.unlink(missing_ok=True)
            why = str(exc) if isinstance(exc, _Lie) else f"does not match the signed target: {exc}"
            if again or not resumed:
                raise Mismatch(
                    f"download of {target.path} from byte 0: {why}; the mirror is at fault, "
                    "the next attempt starts again from byte 0"
                ) from None
            log.warning("%s: %s: discarding the partial file, downloading it again from "
                        "byte 0", target.path, why)  # fmt: skip
            have, again = 0, True
    os.replace(part, done_path)
    return done_path


def _open(
    http: urllib3.PoolManager, url: str, have: int, timeout_s: float
) -> urllib3.BaseHTTPResponse:
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        return http.request(
            "GET", url, headers=headers, preload_content=False, timeout=timeout_s, retries=False
        )
    except urllib3.exceptions.HTTPError as exc:
        raise Transient(f"cannot download {url}: {exc}") from None


def _promised(response: urllib3.BaseHTTPResponse, have: int, length: int) -> int:
    """The body length a 206 answer promises, when it is the rest of the signed target
    from byte ``have``; else _Lie."""
    what = response.headers.get("Content-Range", "")
    m = _CONTENT_RANGE.fullmatch(what.strip())
    if m is None or int(m.group(1)) != have or m.group(3) not in (str(length), "*"):
        raise _Lie(f"asked for bytes {have}- of {length}, the mirror answered {what!r}")
    first, last = int(m.group(1)), int(m.group(2))
    if not first <= last < length:
        raise _Lie(f"asked for bytes {have}- of {length}, the mirror answered {what!r}")
    promised = last - first + 1
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.strip() != str(promised):
        raise _Lie(f"the mirror's Content-Range {what!r} promises {promised} bytes, its "
                   f"Content-Length says {declared.strip()}")  # fmt: skip
    return promised


def _transfer(
    http: urllib3.PoolManager,
    url: str,
    target: TargetFile,
    part: Path,
    have: int,
    limits: Limits,
    progress: Progress | None,
) -> None:
    """One request for bytes ``have``- into ``part``; _Lie when the answer is not them."""
    response = _open(http, url, have, limits.timeout_s)
    try:
        if have and response.status in (200, 206, 416):
            if response.status != 206:
                raise _Lie(f"asked for bytes {have}-, the mirror answered HTTP {response.status}")
            promised = _promised(response, have, target.length)
            log.info("resuming %s at %d of %d bytes", target.path, have, target.length)
        elif response.status != 200 or have:
            raise Transient(f"download of {url}: HTTP {response.status}")
        else:
            promised = target.length
        have = _copy(response, target, part, have, have + promised, limits, progress)
    finally:
        response.release_conn()
    if have < target.length:
        raise Transient(
            f"download of {target.path} interrupted at {have} of {target.length} bytes; "
            "the next attempt resumes there"
        )


def _copy(
    response: urllib3.BaseHTTPResponse,
    target: TargetFile,
    part: Path,
    have: int,
    end: int,
    limits: Limits,
    progress: Progress | None,
) -> int:
    """Copy the body into ``part`` from ``have``; _Lie past ``end`` (what the answer
    promised, within the signed length)."""
    started, sent, last_log = time.monotonic(), 0, 0.0
    window_start, window_bytes = started, 0
    with open(part, "r+b" if have else "wb") as f:
        f.seek(have)
        f.truncate()
        try:
            # read1: whatever arrived, so bytes before a break are kept for the resume
            while chunk := response.read1(CHUNK):
                if have + len(chunk) > end:
                    raise _Lie(f"the body runs past byte {end - 1}, the last one promised")
                f.write(chunk)
                have += len(chunk)
                sent += len(chunk)
                window_bytes += len(chunk)
                if progress is not None:
                    progress(have, target.length)
                now = time.monotonic()
                if now - last_log > 5:
                    last_log = now
                    log.info("downloading %s: %d of %d bytes", target.path, have, target.length)
                if limits.deadline and time.time() > limits.deadline and have < target.length:
                    raise Dropped(
                        f"download of {target.path} not done by the job's deadline "
                        f"({have} of {target.length} bytes): dropped"
                    )
                if now - window_start >= limits.window_s:
                    rate = window_bytes / (now - window_start)
                    if limits.min_rate and rate < limits.min_rate:
                        raise Transient(
                            f"download of {target.path}: {rate:.0f} bytes/s, below the "
                            f"minimum of {limits.min_rate} (at {have} of {target.length} "
                            "bytes; the next attempt resumes there)"
                        )
                    window_start, window_bytes = now, 0
                _pace(started, sent, limits.max_bandwidth)
        except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            # (a local write error, such as a full disk, goes on as OSError: the agent
            # handles it)
            raise Transient(
                f"download of {target.path} interrupted at {have} of {target.length} "
                f"bytes ({exc}); the next attempt resumes there"
            ) from None
        finally:
            f.flush()
            os.fsync(f.fileno())
    return have
