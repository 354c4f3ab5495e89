"""Delta bundles: a new version as binary patches against the version a device has.

Fine-tuned models change little between versions (a retrained head, a few layers),
so on a metered link a device downloads a delta instead of the full bundle: an
uncompressed tar holding

- ``delta.json``: format, model name, target and base version, the target's
  content hashes, and per file of the target how to make it: ``same`` (a file of
  the base, unchanged), ``patch`` (zstd's patch-from: the base file is the raw
  dictionary the new file is compressed against, long-distance matching on) or
  ``full`` (the file zstd-compressed on its own);
- the target bundle's ``manifest.json`` and config file, byte for byte;
- ``patch/<path>`` and ``full/<path>`` payloads.

Applying (:func:`apply`) never trusts the delta: the target's manifest and config
must match the content hashes the signed metadata of the *full* target carries
(:func:`content_hashes`, published with it), every base file is checked against
the sha256 the delta was made from, and every rebuilt file against the size and
sha256 of that manifest before it is used. The result is the full bundle, written
as :mod:`appliance.ota.bundle` writes one, which then goes through the same verification as
a downloaded bundle; when the local gzip happens to produce the fleet's bytes its
sha256 even equals the signed full target's (reported, not required: gzip output
differs between zlib builds). Any failure (base missing or changed, damaged delta)
is an :class:`OtaError`, and the agent falls back to the full bundle.

A sealed (encrypted) bundle has no delta: its ciphertext does not diff.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tarfile
import tempfile
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from appliance.ota import OtaError, bundle
from appliance.ota.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, parse, safe_path
from appliance.ota.rollout import check_name

FORMAT = 1
_LEVEL = 19  # the fleet compresses once, devices decompress fast at any level
_MAX_WINDOW_LOG = 31


@dataclass(frozen=True, slots=True)
class DeltaInfo:
    """What :func:`build` wrote: sizes for the report and the target's metadata."""

    name: str
    version: int
    base_version: int
    delta_bytes: int
    target_bytes: int  # the full bundle's size
    files: dict[str, str]  # path -> same | patch | full


def _tar_members(path: Path, limit: int) -> Generator[tuple[str, bytes], None, None]:
    """(name, bytes) of each regular member, each at most ``limit`` bytes."""
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for info in tar:
                if not info.isreg():
                    raise OtaError(f"{path.name}: member {info.name!r} is not a regular file")
                if info.size > limit:
                    raise OtaError(f"{path.name}: member {info.name!r} is over {limit} bytes")
                reader = tar.extractfile(info)
                yield safe_path(info.name), reader.read() if reader is not None else b""
    except (tarfile.TarError, EOFError, OSError, zstandard.ZstdError) as exc:
        raise OtaError(f"{path.name} is not a valid archive: {exc}") from None


def _head(path: Path) -> tuple[bytes, bytes]:
    """A bundle's manifest and config bytes (its first two members)."""
    members = _tar_members(path, MAX_MANIFEST_BYTES)
    try:
        (m_name, manifest), (_, config) = next(members), next(members)
    except StopIteration:
        raise OtaError(f"{path.name}: not a bundle (fewer than two members)") from None
    finally:
        members.close()
    if m_name != "manifest.json":
        raise OtaError(f"{path.name}: the first member is not manifest.json")
    return manifest, config


def content_hashes(bundle_path: Path) -> dict[str, str]:
    """The sha256 of a bundle's manifest and config: published in the full target's
    signed metadata, so a bundle rebuilt from a delta can be checked against it."""
    manifest, config = _head(bundle_path)
    return {
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "config_sha256": hashlib.sha256(config).hexdigest(),
    }


def listed(info: Any) -> dict[int, dict[str, Any]]:
    """The deltas a full target's ``appliance`` metadata names (``deltas``: base
    version -> ``{"path": <delta target path>, "length": n}``); malformed rows are
    left out."""
    raw = info.get("deltas") if isinstance(info, dict) else None
    if not isinstance(raw, dict):
        return {}
    return {
        int(base): row
        for base, row in raw.items()
        if str(base).isdigit() and isinstance(row, dict) and isinstance(row.get("path"), str)
    }


def _params(base_size: int, size: int, level: int) -> zstandard.ZstdCompressionParameters:
    window = min(_MAX_WINDOW_LOG, max(20, math.ceil(math.log2(base_size + size + 1))))
    return zstandard.ZstdCompressionParameters.from_level(
        level, window_log=window, enable_ldm=1, source_size=size, write_checksum=1
    )


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def build(base: Path, target: Path, out: Path, level: int = _LEVEL) -> DeltaInfo:
    """The delta that turns the ``base`` bundle's version into the ``target``
    bundle's (fleet side; both bundles are verified as a device would first)."""
    with tempfile.TemporaryDirectory(prefix="appliance-delta-") as tmp:
        old_dir, new_dir = Path(tmp) / "base", Path(tmp) / "target"
        old, _ = bundle.extract(base, old_dir, 1 << 40)
        new, _ = bundle.extract(target, new_dir, 1 << 40)
        if old.name != new.name or old.version >= new.version:
            raise OtaError(
                f"a delta goes from an older version of one model to a newer one, not from "
                f"{old.name} {old.version} to {new.name} {new.version}"
            )
        manifest_bytes, config_bytes = _head(target)
        by_hash = {e.sha256: e for e in old.files}
        by_path = {e.path: e for e in old.files}
        files: list[dict[str, Any]] = []
        payloads: list[tuple[str, bytes]] = []
        for entry in new.files:
            data = (new_dir / entry.path).read_bytes()
            same = by_hash.get(entry.sha256)
            if same is not None:
                files.append({"path": entry.path, "how": "same", "from": same.path})
                continue
            plain = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(data)
            how, payload, source = "full", plain, None
            base_entry = by_path.get(entry.path)
            if base_entry is not None:
                ref = (old_dir / base_entry.path).read_bytes()
                cdict = zstandard.ZstdCompressionDict(ref, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
                params = _params(len(ref), len(data), level)
                patch = zstandard.ZstdCompressor(
                    dict_data=cdict, compression_params=params
                ).compress(data)
                if len(patch) < len(plain):
                    how, payload, source = "patch", patch, base_entry
            row: dict[str, Any] = {"path": entry.path, "how": how}
            if source is not None:
                row["from"], row["from_sha256"] = source.path, source.sha256
            files.append(row)
            payloads.append((f"{how}/{entry.path}", payload))
        for row in files:  # what a "same" file must be on the device
            if row["how"] == "same":
                row["from_sha256"] = by_path[row["from"]].sha256
        doc = {
            "format": FORMAT,
            "name": new.name,
            "version": new.version,
            "base_version": old.version,
            "config_file": new.config_file,
            **content_hashes(target),
            "files": files,
        }
        tmp_out = out.with_name(f".{out.name}.tmp")
        with tarfile.open(tmp_out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, "delta.json", json.dumps(doc, sort_keys=True, indent=1).encode())
            _add(tar, "manifest.json", manifest_bytes)
            _add(tar, new.config_file, config_bytes)
            for name, payload in payloads:
                _add(tar, name, payload)
        os.replace(tmp_out, out)
    return DeltaInfo(
        new.name,
        new.version,
        old.version,
        out.stat().st_size,
        target.stat().st_size,
        {row["path"]: row["how"] for row in files},
    )


# ---- the device's side --------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_doc(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # (nested beyond the recursion limit)
        raise OtaError("delta: delta.json is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise OtaError(f"delta: expected delta.json of format {FORMAT}")
    files = doc.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise OtaError("delta: 'files' must be a list of objects")
    return doc


def _base_file(base_dir: Path, row: dict[str, Any]) -> bytes:
    """The installed base file a row builds on, checked against the hash the fleet
    made the delta from."""
    path = base_dir / safe_path(str(row.get("from", "")))
    try:
        if path.is_symlink():
            raise OSError("a link")
        data = path.read_bytes()
    except OSError as exc:
        raise OtaError(f"delta: the base file {row.get('from')!r} cannot be read: {exc}") from None
    if _sha(data) != row.get("from_sha256"):
        raise OtaError(f"delta: the base file {row.get('from')!r} is not the one the delta is from")
    return data


def _rebuild(row: dict[str, Any], entry: FileEntry, payload: bytes | None, base_dir: Path) -> bytes:
    how = row.get("how")
    if how == "same":
        data = _base_file(base_dir, row)
    elif how in ("patch", "full") and payload is not None:
        declared = zstandard.frame_content_size(payload)
        if declared != entry.size:  # never allocate what a hostile frame claims
            raise OtaError(f"delta: {entry.path!r} claims {declared} bytes, not {entry.size}")
        ref = _base_file(base_dir, row) if how == "patch" else b""
        kwargs: dict[str, Any] = {"max_window_size": 1 << _MAX_WINDOW_LOG}
        if ref:
            kwargs["dict_data"] = zstandard.ZstdCompressionDict(
                ref, dict_type=zstandard.DICT_TYPE_RAWCONTENT
            )
        try:
            data = zstandard.ZstdDecompressor(**kwargs).decompress(payload, entry.size)
        except zstandard.ZstdError as exc:
            raise OtaError(f"delta: {entry.path!r} does not decompress: {exc}") from None
    else:
        raise OtaError(f"delta: no way to make {entry.path!r} (how {how!r})")
    if len(data) != entry.size or _sha(data) != entry.sha256:
        raise OtaError(f"delta: the rebuilt {entry.path!r} does not match the manifest")
    return data


def apply(
    delta_path: Path,
    base_dir: Path,
    out: Path,
    expected: dict[str, str],
    max_bytes: int,
) -> Manifest:
    """Rebuild the full bundle from ``delta_path`` and the installed base version
    folder ``base_dir`` into ``out``. ``expected``: the full target's signed
    :func:`content_hashes`. OtaError (and nothing written) on any mismatch."""
    members = dict(_tar_members(delta_path, max_bytes))
    doc = _read_doc(members.get("delta.json", b"{}"))
    manifest_bytes = members.get("manifest.json", b"")
    if _sha(manifest_bytes) != expected.get("manifest_sha256"):
        raise OtaError("delta: its manifest is not the signed target's")
    manifest = parse(manifest_bytes)
    config_name = manifest.config_file
    config = members.get(config_name, b"")
    if _sha(config) != expected.get("config_sha256"):
        raise OtaError("delta: its config is not the signed target's")
    check_name(str(doc.get("name")), "model name")
    if (doc.get("name"), doc.get("version")) != (manifest.name, manifest.version):
        raise OtaError("delta: delta.json and the manifest name different versions")
    if manifest.payload_bytes() > max_bytes:
        raise OtaError(f"delta: the target holds more than {max_bytes} bytes (limit)")
    rows = {safe_path(str(r.get("path", ""))): r for r in doc["files"]}
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with bundle.writer(tmp, manifest_bytes, config_name, config) as add:
            for entry in manifest.files:
                row = rows.get(entry.path)
                if row is None:
                    raise OtaError(f"delta: no way to make {entry.path!r}")
                payload = members.get(f"{row.get('how')}/{entry.path}")
                add(entry, io.BytesIO(_rebuild(row, entry, payload, base_dir)))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return manifest
