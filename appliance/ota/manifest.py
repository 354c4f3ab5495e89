"""A bundle's manifest: what the bundle claims to hold, validated before it is used.

``manifest.json`` is the first member of every bundle. Nothing in it is trusted
until the bundle itself has been verified against the signed TUF target; even
then every field is checked here (names, versions, paths, sizes, hashes) before
any of it reaches a file name or the server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from appliance.ota import OtaError, shadow
from appliance.ota.rollout import check_name

FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20
PLATFORMS = ("x86_64", "aarch64")
DEVICES = ("cpu", "gpu")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_VERSION = re.compile(r"\d+(\.\d+){0,3}")


def safe_path(name: str) -> str:
    """A relative POSIX path with no '..', no absolute start, no odd characters."""
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or len(name) > 255
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise OtaError(f"unsafe path {name!r} (absolute, '..', empty part or too long)")
    if any(ord(c) < 32 for c in name):
        raise OtaError(f"unsafe path {name!r} (control character)")
    return str(PurePosixPath(name))


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # below model/ in the bundle, below the version folder once installed
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    version: int
    backend: str
    config_file: str  # config.yaml or config.pbtxt, the model's config as it was built
    files: tuple[FileEntry, ...]
    min_appliance_version: str = "0.1.0"
    platforms: tuple[str, ...] = PLATFORMS
    devices: tuple[str, ...] = ("cpu",)
    memory_bytes: int = 0  # what loading it needs at least (0: unknown)
    self_test: tuple[dict[str, Any], ...] = field(default=())
    # shadow probation's policy, as validated by ota.shadow.parse (None: no shadow)
    shadow: dict[str, Any] | None = None
    # the key ids the model files are sealed to (appliance/backends/sealed_crypto.py; (): plain)
    sealed_to: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "version": self.version,
            "backend": self.backend,
            "config_file": self.config_file,
            "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files],
            "min_appliance_version": self.min_appliance_version,
            "platforms": list(self.platforms),
            "devices": list(self.devices),
            "memory_bytes": self.memory_bytes,
            "self_test": list(self.self_test),
            **({"shadow": self.shadow} if self.shadow is not None else {}),
            **({"sealed_to": list(self.sealed_to)} if self.sealed_to else {}),
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, indent=1).encode() + b"\n"

    def summary(self) -> dict[str, Any]:
        """What the targets metadata repeats, so a device can skip a bundle it cannot
        use before downloading it."""
        return {
            "name": self.name,
            "version": self.version,
            "backend": self.backend,
            "min_appliance_version": self.min_appliance_version,
            "platforms": list(self.platforms),
            "devices": list(self.devices),
            "memory_bytes": self.memory_bytes,
            "unpacked_bytes": self.payload_bytes(),
            **({"sealed_to": list(self.sealed_to)} if self.sealed_to else {}),
        }

    def payload_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _strings(doc: dict[str, Any], key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    value = doc.get(key, list(allowed))
    if not isinstance(value, list) or not value or not all(v in allowed for v in value):
        raise OtaError(f"manifest: '{key}' must be a non-empty list of {', '.join(allowed)}")
    return tuple(value)


def parse(data: bytes) -> Manifest:
    """Validate manifest bytes; OtaError naming the first bad field."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise OtaError("manifest: larger than 1 MiB")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # (nested beyond the recursion limit)
        raise OtaError(f"manifest: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise OtaError(f"manifest: expected an object with format {FORMAT}")
    name, version = doc.get("name"), doc.get("version")
    if not isinstance(name, str):
        raise OtaError("manifest: 'name' must be a string")
    check_name(name, "model name")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise OtaError(f"manifest: 'version' must be an integer >= 1, got {version!r}")
    backend, config_file = doc.get("backend"), doc.get("config_file")
    if not isinstance(backend, str) or not re.fullmatch(r"[a-z0-9_]{1,32}", backend):
        raise OtaError(f"manifest: 'backend' {backend!r} is not a backend name")
    if config_file not in ("config.yaml", "config.pbtxt"):
        raise OtaError("manifest: 'config_file' must be config.yaml or config.pbtxt")
    raw_files = doc.get("files")
    if not isinstance(raw_files, list) or not raw_files:
        raise OtaError("manifest: 'files' must be a non-empty list")
    files, seen = [], set()
    for i, f in enumerate(raw_files):
        if not isinstance(f, dict):
            raise OtaError(f"manifest: files[{i}] must be an object")
        path, digest, size = f.get("path"), f.get("sha256"), f.get("size")
        if not isinstance(path, str):
            raise OtaError(f"manifest: files[{i}].path must be a string")
        path = safe_path(path)
        if path in seen:
            raise OtaError(f"manifest: {path!r} is listed twice")
        seen.add(path)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise OtaError(f"manifest: files[{i}].sha256 must be 64 lowercase hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OtaError(f"manifest: files[{i}].size must be an integer >= 0")
        files.append(FileEntry(path, digest, size))
    minimum = doc.get("min_appliance_version", "0.1.0")
    if not isinstance(minimum, str) or not _VERSION.fullmatch(minimum):
        raise OtaError(f"manifest: 'min_appliance_version' {minimum!r} is not a version")
    memory = doc.get("memory_bytes", 0)
    if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
        raise OtaError("manifest: 'memory_bytes' must be an integer >= 0")
    vectors = doc.get("self_test", [])
    if not isinstance(vectors, list) or not all(isinstance(v, dict) for v in vectors):
        raise OtaError("manifest: 'self_test' must be a list of objects")
    parsed = shadow.parse(doc.get("shadow"))
    policy = parsed.to_json() if parsed is not None else None
    sealed_to = doc.get("sealed_to", [])
    if not isinstance(sealed_to, list) or not all(
        isinstance(k, str) and _KEY_ID.fullmatch(k) for k in sealed_to
    ):
        raise OtaError("manifest: 'sealed_to' must be a list of key ids (16 hex digits)")
    return Manifest(
        name,
        version,
        backend,
        config_file,
        tuple(files),
        minimum,
        _strings(doc, "platforms", PLATFORMS),
        _strings(doc, "devices", DEVICES),
        memory,
        tuple(vectors),
        policy,
        tuple(sealed_to),
    )


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:4])
