"""The fleet's TUF repository: a folder any static web server can serve as is.

Layout: ``REPO/metadata/`` holds ``<N>.root.json`` (``1.root.json`` is what
devices pin), ``<N>.targets.json``, ``<N>.snapshot.json`` and ``timestamp.json``
(consistent snapshots, so a CDN can cache everything but the timestamp forever),
plus unversioned copies of the newest root, targets and snapshot for this tool
itself; ``REPO/targets/<model>/<sha256>.<model>-<version>.bundle`` the bundles.

Every change re-signs targets, snapshot and timestamp in that order and writes
each file through a temporary name and a rename, so a server reading the folder
meanwhile sees the old or the new repository, never half a file. The targets
metadata carries each bundle's rollout settings (see :mod:`appliance.ota.rollout`) in the
target's ``custom`` field, signed with everything else.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from appliance.ota import ROLES, OtaError, bundle, clock, delta, keys, release, software
from appliance.ota.rollout import Rollout

_SERIALIZER = JSONSerializer(compact=False)


@dataclass(frozen=True, slots=True)
class Expiry:
    """How long each role's metadata stays valid after it is signed. The timestamp is
    short so that a frozen (replayed) repository is noticed within a day; re-sign it
    with ``appliance fleet refresh`` from a timer."""

    root: timedelta = timedelta(days=365)
    targets: timedelta = timedelta(days=90)
    snapshot: timedelta = timedelta(days=30)
    timestamp: timedelta = clock.TIMESTAMP_LIFETIME


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save(meta_dir: Path, md: Metadata[Any], versioned: bool, plain: bool = True) -> None:
    data = md.to_bytes(_SERIALIZER)
    role = md.signed.type
    if versioned:
        _write(meta_dir / f"{md.signed.version}.{role}.json", data)
    if plain:
        _write(meta_dir / f"{role}.json", data)


def _load(meta_dir: Path, role: str) -> Metadata[Any]:
    path = meta_dir / f"{role}.json"
    try:
        return Metadata.from_file(str(path))
    except FileNotFoundError:
        raise OtaError(f"{path} does not exist: run 'appliance fleet init' first") from None


def init(repo: Path, keys_dir: Path, expiry: Expiry | None = None) -> Path:
    """Create an empty signed repository in ``repo``; returns ``metadata/1.root.json``."""
    expiry = expiry or Expiry()
    meta_dir = repo / "metadata"
    if (meta_dir / "root.json").exists():
        raise OtaError(f"{repo} already holds a repository ({meta_dir / 'root.json'})")
    meta_dir.mkdir(parents=True, exist_ok=True)
    (repo / "targets").mkdir(exist_ok=True)
    now = _now()
    root = Root(expires=now + expiry.root, consistent_snapshot=True)
    for role in ROLES:
        root.add_key(keys.public(keys_dir, role), role)
    root_md = Metadata(root)
    root_md.sign(keys.signer(keys_dir, "root"))
    _save(meta_dir, root_md, versioned=True)
    _sign_chain(repo, keys_dir, Metadata(Targets(expires=now + expiry.targets)), expiry)
    return meta_dir / "1.root.json"


def _sign_chain(
    repo: Path, keys_dir: Path, targets: Metadata[Targets], expiry: Expiry, bump: bool = False
) -> None:
    """Sign ``targets``, then a new snapshot and timestamp naming it, and write all three."""
    meta_dir = repo / "metadata"
    now = _now()
    if bump:
        targets.signed.version += 1
    targets.signed.expires = now + expiry.targets
    targets.signatures.clear()
    targets.sign(keys.signer(keys_dir, "targets"))
    _save(meta_dir, targets, versioned=True)
    snapshot_path = meta_dir / "snapshot.json"
    if snapshot_path.exists():
        snapshot: Metadata[Snapshot] = _load(meta_dir, "snapshot")
        snapshot.signed.version += 1
    else:
        snapshot = Metadata(Snapshot())
    snapshot.signed.meta["targets.json"] = MetaFile(version=targets.signed.version)
    snapshot.signed.expires = now + expiry.snapshot
    snapshot.signatures.clear()
    snapshot.sign(keys.signer(keys_dir, "snapshot"))
    _save(meta_dir, snapshot, versioned=True)
    refresh(repo, keys_dir, expiry, snapshot.signed.version)


def refresh(
    repo: Path, keys_dir: Path, expiry: Expiry | None = None, snapshot_version: int = 0
) -> Timestamp:
    """Re-sign the timestamp (a new version with a new expiry), written last; returns it."""
    expiry = expiry or Expiry()
    meta_dir = repo / "metadata"
    if not snapshot_version:
        snapshot_version = _load(meta_dir, "snapshot").signed.version
    path = meta_dir / "timestamp.json"
    if path.exists():
        timestamp: Metadata[Timestamp] = _load(meta_dir, "timestamp")
        timestamp.signed.version += 1
    else:
        timestamp = Metadata(Timestamp())
    timestamp.signed.snapshot_meta = MetaFile(version=snapshot_version)
    timestamp.signed.expires = _now() + expiry.timestamp
    timestamp.signatures.clear()
    timestamp.sign(keys.signer(keys_dir, "timestamp"))
    _save(meta_dir, timestamp, versioned=False)
    return timestamp.signed


def target_path(model: str, version: int) -> str:
    """The TUF target path of a bundle (devices ask for it by this name)."""
    return f"{model}/{model}-{version}.bundle"


def delta_path(model: str, version: int, base: int) -> str:
    """The TUF target path of the delta from version ``base`` to ``version``."""
    return f"{model}/{model}-{version}.from-{base}.delta"


def deltas_of(target: TargetFile) -> dict[int, dict[str, Any]]:
    """The deltas a full target names: base version -> {path, length}."""
    custom = target.custom if isinstance(target.custom, dict) else {}
    return delta.listed(custom.get("appliance"))


def _store(repo: Path, path: str, source: Path, digest: str) -> None:
    """Copy a target's file to where devices fetch it (consistent snapshot names)."""
    model, _, name = path.rpartition("/")
    folder = repo / "targets" / model
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{digest}.{name}"
    if not dest.exists():
        tmp = folder / f".{dest.name}.tmp"
        shutil.copyfile(source, tmp)
        os.replace(tmp, dest)


def _add_deltas(
    targets: Metadata[Targets], repo: Path, bundle_file: Path, bases: tuple[Path, ...]
) -> dict[str, Any]:
    """A delta target from each base bundle to ``bundle_file``; the ``deltas`` field."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="appliance-publish-") as tmp:
        for base in bases:
            made = Path(tmp) / f"{len(out)}.delta"
            info = delta.build(base, bundle_file, made)
            path = delta_path(info.name, info.version, info.base_version)
            target = TargetFile.from_file(path, str(made), ["sha256"])
            target.unrecognized_fields["custom"] = {
                "appliance_delta": {
                    "name": info.name, "version": info.version, "base_version": info.base_version
                }
            }  # fmt: skip
            _store(repo, path, made, target.hashes["sha256"])
            targets.signed.targets[path] = target
            out[str(info.base_version)] = {"path": path, "length": target.length}
    return out


def publish(
    repo: Path,
    keys_dir: Path,
    bundle_file: Path,
    rollout: Rollout,
    expiry: Expiry | None = None,
    delta_from: tuple[Path, ...] = (),
) -> TargetFile:
    """Add a bundle as a target with its rollout settings and re-sign.

    The bundle is inspected first (a malformed one is refused here, not on the
    devices). A version already published with other bytes is refused: a version
    number names one set of bytes forever. ``delta_from``: older bundles of the
    model to publish a delta from as well (not for sealed bundles: ciphertext does
    not diff).
    """
    expiry = expiry or Expiry()
    if software.first(bundle_file).get("kind") == software.KIND:
        return _publish_software(repo, keys_dir, bundle_file, rollout, expiry)
    manifest, config = bundle.read(bundle_file)
    release.check_bundle(manifest, config)  # what a device would refuse, refused here
    path = target_path(manifest.name, manifest.version)
    meta_dir = repo / "metadata"
    targets: Metadata[Targets] = _load(meta_dir, "targets")
    for other in targets.signed.targets.values():
        info = other.custom.get("appliance", {}) if isinstance(other.custom, dict) else {}
        if info.get("name") == manifest.name and info.get("version") != manifest.version:
            where = f"is published (version {info.get('version')})"
            release.check_backend(manifest.name, manifest.backend, str(info.get("backend")), where)
    digest = _sha256(bundle_file)
    known = targets.signed.targets.get(path)
    if known is not None and known.hashes.get("sha256") != digest:
        raise OtaError(
            f"{manifest.name} version {manifest.version} is already published with other "
            f"bytes; publish a new version number instead"
        )
    if delta_from and manifest.sealed_to:
        raise OtaError("a sealed bundle has no delta (its ciphertext does not diff)")
    deltas = dict(known.custom.get("appliance", {}).get("deltas", {})) if known else {}
    deltas.update(_add_deltas(targets, repo, bundle_file, delta_from))
    target = TargetFile.from_file(path, str(bundle_file), ["sha256"])
    signed: dict[str, Any] = {**manifest.summary(), "rollout": rollout.to_json()}
    signed["content"] = delta.content_hashes(bundle_file)
    if deltas:
        signed["deltas"] = deltas
    target.unrecognized_fields["custom"] = {"appliance": signed}
    _store(repo, path, bundle_file, digest)
    targets.signed.targets[path] = target
    _sign_chain(repo, keys_dir, targets, expiry, bump=True)
    return target


def _publish_software(
    repo: Path, keys_dir: Path, bundle_file: Path, rollout: Rollout, expiry: Expiry
) -> TargetFile:
    """A software bundle as a target of its own kind, ``appliance/appliance-<v>.software``,
    with the same rollout settings a model bundle has."""
    manifest = software.read(bundle_file, bundle.DEFAULT_MAX_BYTES)
    path = f"{software.NAME}/{software.NAME}-{manifest.version}.software"
    targets: Metadata[Targets] = _load(repo / "metadata", "targets")
    digest = _sha256(bundle_file)
    known = targets.signed.targets.get(path)
    if known is not None and known.hashes.get("sha256") != digest:
        raise OtaError(f"software {manifest.version} is already published with other bytes")
    target = TargetFile.from_file(path, str(bundle_file), ["sha256"])
    signed = {**manifest.summary(), "rollout": rollout.to_json()}
    target.unrecognized_fields["custom"] = {"appliance": signed}
    _store(repo, path, bundle_file, digest)
    targets.signed.targets[path] = target
    _sign_chain(repo, keys_dir, targets, expiry, bump=True)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def remove(
    repo: Path, keys_dir: Path, model: str, version: int, expiry: Expiry | None = None
) -> None:
    """Withdraw ``model`` version ``version`` from the signed targets and re-sign; the
    bundle file stays (devices that have it verify against the metadata, not the file)."""
    targets: Metadata[Targets] = _load(repo / "metadata", "targets")
    path = target_path(model, version)
    removed = targets.signed.targets.pop(path, None)
    if removed is None:
        raise OtaError(f"model '{model}' version {version} is not published in {repo}")
    for row in deltas_of(removed).values():  # its deltas go with it
        targets.signed.targets.pop(row["path"], None)
    _sign_chain(repo, keys_dir, targets, expiry or Expiry(), bump=True)


def rotate(repo: Path, keys_dir: Path, role: str, expiry: Expiry | None = None) -> int:
    """Replace ``role``'s key: a new root version lists the new key and is signed by
    the old root key and (for the root role) the new one, so devices that trust the
    old root accept it. Returns the new root version."""
    if role not in ROLES:
        raise OtaError(f"unknown role {role!r}, expected one of {', '.join(ROLES)}")
    expiry = expiry or Expiry()
    meta_dir = repo / "metadata"
    root_md: Metadata[Root] = _load(meta_dir, "root")
    old_root_signer = keys.signer(keys_dir, "root")
    keys.generate(keys_dir, (role,), replace=True)
    root = root_md.signed
    for keyid in list(root.roles[role].keyids):
        root.revoke_key(keyid, role)
    root.add_key(keys.public(keys_dir, role), role)
    root.version += 1
    root.expires = _now() + expiry.root
    root_md.signatures.clear()
    root_md.sign(old_root_signer, append=True)
    if role == "root":
        root_md.sign(keys.signer(keys_dir, "root"), append=True)
    _save(meta_dir, root_md, versioned=True)
    # everything the rotated key signed is signed again with the new one
    if role in ("targets", "snapshot"):
        _sign_chain(repo, keys_dir, _load(meta_dir, "targets"), expiry, bump=True)
    elif role == "timestamp":
        refresh(repo, keys_dir, expiry)
    (keys_dir / f"{role}.old.pem").unlink(missing_ok=True)
    return root.version


def listing(repo: Path) -> list[dict[str, Any]]:
    """Every published bundle with its rollout, newest version of each model first."""
    targets: Metadata[Targets] = _load(repo / "metadata", "targets")
    rows = [
        {"path": p, "length": t.length, **t.custom.get("appliance", {})}
        for p, t in targets.signed.targets.items()
    ]
    return sorted(rows, key=lambda r: (str(r.get("name")), -int(r.get("version", 0))))
